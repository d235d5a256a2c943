"""One rank of one replica group of a fault-tolerant job (torchft), for tests/test_fault_tolerance.py
and benchmarks/bench_fault_tolerance.py.

Started by torchrun (one torchrun per replica group). Trains the model of `ft_model` on batches
that depend only on (step, group, rank), so a one-process reference can replay exactly the steps
that were committed with exactly the groups that took part. Every rank appends one JSON line per
step to OUT/group{G}_rank{R}.jsonl; rank 0 writes the group's final full weights at the end.

--engine shardkit: shardkit.shard(HYBRID_SHARD, fault_tolerance=...) + fault_tolerant_optimizer.
--engine fsdp2: torch's fully_shard over the group + torchft (torchtitan's recipe: FSDP2's
    all-reduce hook runs the Manager's all-reduce; torchft's OptimizerWrapper).
--engine plain: shardkit HYBRID_SHARD over every group as one job (no torchft), for timing.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from _ft_model import batch, build_model


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--group", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--engine", default="shardkit", choices=("shardkit", "fsdp2", "plain"))
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--kill-at", type=int, default=-1,
                    help="every rank SIGKILLs itself at this step, once: between its forward and "
                         "backward (the other groups are then inside the step's all-reduce)")
    ap.add_argument("--ckpt", default="", help="shardkit engine: save a sharded checkpoint here at the end")
    ap.add_argument("--stats-at", type=int, default=-1,
                    help="record comm_stats of this step (shardkit engines)")
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds each step waits (pacing)")
    ap.add_argument("--pace-until-groups", type=int, default=0,
                    help="while a step has fewer groups than this, it waits 0.4 s more: a "
                         "survivor then outlasts the others' relaunch (measured up to 10.5 s "
                         "for two groups at once under load) instead of finishing first")
    ap.add_argument("--timeout", type=float, default=20.0)
    ap.add_argument("--quorum-timeout", type=float, default=30.0)
    ap.add_argument("--min-groups", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0, help="the seed the model is built from")
    return ap.parse_args()


def shardkit_setup(args, model):
    import shardkit

    if args.engine == "plain":
        model = shardkit.shard(model, strategy="hybrid_shard",
                               hybrid_group_size=int(os.environ["LOCAL_WORLD_SIZE"]))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, opt, None
    ft = shardkit.FaultTolerance(replica_group=args.group, timeout_s=args.timeout,
                                 quorum_timeout_s=args.quorum_timeout,
                                 min_replica_groups=args.min_groups)
    model = shardkit.shard(model, strategy="hybrid_shard", fault_tolerance=ft)
    opt = shardkit.fault_tolerant_optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return model, opt, opt


def fsdp2_setup(args, model):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torchft.manager import Manager
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ProcessGroupGloo

    # The group's default process group comes from shardkit.init(): a plain
    # init_process_group("gloo") in a group torchrun restarted failed here ("Gloo connectFullMesh
    # failed ... Connection refused" to its own node); shardkit's job-store rendezvous does not.
    import shardkit

    shardkit.init(backend="cpu")
    # A group torchrun restarts finds the dead incarnation's Manager address in the store and
    # waits on it (seen here: the restarted group never came back); shardkit clears it the same way.
    if dist.get_rank() == 0:
        from shardkit.fault_tolerance.cross_groups import clear_manager_keys

        clear_manager_keys(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    dist.barrier()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)

    # This rank's shards as plain tensors: torchft's HTTP transport cannot stream FSDP2's
    # DTensor state_dict ("both buffer length (0) and count (-1) must not be 0" on receipt).
    from torch.distributed.tensor import DTensor

    def save():
        local = {n: v.to_local().clone() if isinstance(v, DTensor) else v
                 for n, v in model.state_dict().items()}
        return {"model": local, "optim": inner.state_dict()}

    def load(sd):
        with torch.no_grad():
            for n, v in model.state_dict().items():
                (v.to_local() if isinstance(v, DTensor) else v).copy_(sd["model"][n])
        inner.load_state_dict(sd["optim"])

    manager = Manager(pg=ProcessGroupGloo(), load_state_dict=load, state_dict=save,
                      min_replica_size=args.min_groups,
                      timeout=__import__("datetime").timedelta(seconds=args.timeout),
                      quorum_timeout=__import__("datetime").timedelta(seconds=args.quorum_timeout),
                      replica_id=f"fsdp2_replica_group_{args.group}",
                      # torchft 0.2.0 sends a healthy group's state from its quorum thread; with
                      # the async quorum that read races FSDP2's forward, which swaps and frees
                      # the parameters it reads ("storage of size 0", "mixed torch.Tensor and
                      # DTensor" seen here). A synchronous quorum sends before the forward starts.
                      use_async_quorum=False)

    def hook(output: torch.Tensor) -> None:
        manager.allreduce(output).wait()

    for module in [*model.layers, model]:
        module.set_all_reduce_hook(hook)
    opt = OptimizerWrapper(manager, inner)
    return model, opt, manager


def full_weights(args, model) -> dict[str, torch.Tensor]:
    if args.engine == "fsdp2":
        return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    import shardkit

    return {n: shardkit.full_tensor(p).clone() for n, p in model.named_parameters()}


def main() -> None:
    args = parse()
    rank = int(os.environ["RANK"])
    out = Path(args.out)
    if args.engine == "fsdp2":
        torch.manual_seed(0)
        model = build_model(args.width)
        model, opt, manager = fsdp2_setup(args, model)
    else:
        import shardkit

        shardkit.init()
        rank = shardkit.current_context().world.rank
        torch.manual_seed(args.seed)
        model = build_model(args.width)
        model, opt, manager = shardkit_setup(args, model)
    group_rank = rank % int(os.environ["LOCAL_WORLD_SIZE"]) if args.engine == "plain" else rank
    group = args.group if args.engine != "plain" else rank // int(os.environ["LOCAL_WORLD_SIZE"])
    log = open(out / f"group{group}_rank{group_rank}.jsonl", "a", buffering=1)
    marker = out / f"killed_group{group}_rank{group_rank}"  # each rank's own: no race
    log.write(json.dumps({"event": "start", "t": time.time(), "pid": os.getpid()}) + "\n")

    def current_step(i: int) -> int:
        if args.engine == "plain":
            return i
        if args.engine == "fsdp2":
            return manager.current_step()
        return opt.current_step

    i = 0
    while current_step(i) < args.steps:
        step = current_step(i)
        t0 = time.time()
        opt.zero_grad()
        x, y = batch(step, group, group_rank, args.width)
        loss = F.mse_loss(model(x), y)
        if step == args.kill_at and not marker.exists():
            marker.write_text(str(time.time()))
            log.write(json.dumps({"event": "kill", "step": step, "t": time.time()}) + "\n")
            log.close()
            os.kill(os.getpid(), signal.SIGKILL)
        if step == args.stats_at and args.engine != "fsdp2":
            import shardkit

            shardkit.comm_stats(model, reset=True)
        loss.backward()
        ft_manager = manager if args.engine == "fsdp2" else getattr(opt, "cross_groups", None)
        ft_manager = getattr(ft_manager, "manager", ft_manager)
        if ft_manager is not None:
            participating = ft_manager.is_participating()
            participants = ft_manager.num_participants()
            quorum = ft_manager._quorum_id
        else:
            participating, participants, quorum = True, 1, 0
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if participants < args.pace_until_groups:
            time.sleep(0.4)
        opt.step()
        committed = True
        if args.engine == "shardkit":
            committed = bool(opt.committed)
        elif args.engine == "fsdp2":
            committed = manager.current_step() > step
        t1 = time.time()
        if step == args.stats_at and args.engine != "fsdp2":
            import shardkit

            log.write(json.dumps({"event": "comm_stats", "step": step, "participants": participants,
                                  "stats": shardkit.comm_stats(model)}) + "\n")
        log.write(json.dumps({"step": step, "committed": committed, "participating": participating,
                              "participants": participants, "quorum": quorum, "loss": loss.item(), "t0": t0,
                              "t1": t1}) + "\n")
        i += 1
    weights = full_weights(args, model)
    if args.ckpt:
        import shardkit.checkpoint as ck

        ck.save(Path(args.ckpt) / f"group{group}", model, opt, step=current_step(i))
    if group_rank == 0:
        torch.save(weights, out / f"final_group{group}.pt")
    log.write(json.dumps({"event": "done", "t": time.time()}) + "\n")
    log.close()
    if args.engine == "fsdp2":
        manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
