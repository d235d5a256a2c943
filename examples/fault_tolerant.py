"""Keep training when a replica group dies: HYBRID_SHARD across groups on torchft (`shardkit[ft]`).

On one machine, simulated groups (the lighthouse and every group on 127.0.0.1):

    python examples/fault_tolerant.py --groups 3 --steps 150 --kill-group 2 --kill-at 30

starts torchft's lighthouse and one `torchrun --nproc-per-node 2 --max-restarts 1` per replica
group, each running this file as its training script; group 2 dies at step 30 (every rank
SIGKILLs itself), the other groups go on training without it, torchrun restarts it, and it
rejoins with the current weights and optimizer state sent by a healthy group. The summary says
how long the survivors stalled and how long the group took to rejoin.

On a cluster, start the lighthouse once (`torchft_lighthouse --min_replicas 1`) and launch each
replica group as its own job, on its own nodes, with the same script:

    TORCHFT_LIGHTHOUSE=http://LIGHTHOUSE_HOST:29510 torchrun --nnodes 2 --nproc-per-node 8 \\
        --max-restarts 10 ... examples/fault_tolerant.py --train --group $GROUP

What the training script adds to an ordinary loop is three lines: fault_tolerance= in shard(),
the optimizer wrapped by shardkit.fault_tolerant_optimizer, and a loop over the committed step
(a restarted group jumps to the others' step; a step a group failed in is retried).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import shardkit
from shardkit.demo.data import load_digits_28, require_scikit_learn


def build_model() -> torch.nn.Module:
    """Digits classifier; every group builds the same initial weights (checked at the first step)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(28 * 28, 128), torch.nn.GELU(),
                               torch.nn.Linear(128, 128), torch.nn.GELU(), torch.nn.Linear(128, 10))


def train(args: argparse.Namespace) -> None:
    """One rank of replica group `args.group` (started by torchrun)."""
    shardkit.init()
    rank = shardkit.current_context().world.rank
    model = shardkit.shard(build_model(), strategy="hybrid_shard",
                           fault_tolerance=shardkit.FaultTolerance(replica_group=args.group))
    optimizer = shardkit.fault_tolerant_optimizer(
        model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    train_split, _ = load_digits_28()
    images, labels = train_split.images, train_split.labels
    log = Path(args.log_dir) / f"group{args.group}.jsonl" if args.log_dir else None
    if log is not None and rank == 0:
        with log.open("a") as f:
            f.write(json.dumps({"event": "start", "t": time.time()}) + "\n")
    while optimizer.current_step < args.steps:
        step = optimizer.current_step
        if step == args.kill_at and args.group == args.kill_group and not _already_killed(args):
            os.kill(os.getpid(), signal.SIGKILL)  # the failure this example shows
        # Each group and rank takes its own slice of the step's batch: the data depends on the
        # step, so a retried step or a rejoining group sees the batches it would have seen.
        gen = torch.Generator().manual_seed(step * 1000 + args.group * 10 + rank)
        rows = torch.randint(len(images), (args.batch,), generator=gen)
        t0 = time.time()
        optimizer.zero_grad()  # joins this step's quorum of replica groups
        loss = F.cross_entropy(model(images[rows]), labels[rows])
        loss.backward()  # the gradient is averaged over this group's ranks, then across groups
        optimizer.step()  # steps only if every group in the quorum finished this step
        if log is not None and rank == 0:
            with log.open("a") as f:
                f.write(json.dumps({"step": step, "loss": loss.item(), "t": time.time(),
                                    "s": time.time() - t0, "committed": optimizer.committed,
                                    "groups": optimizer.participating_groups}) + "\n")
        if args.sleep:
            time.sleep(args.sleep)  # pacing, so the demo's outage is visible
    if rank == 0:
        print(f"group {args.group}: {optimizer.current_step} steps committed, "
              f"{optimizer.batches_committed} group-batches, last loss {loss.item():.3f}")


def _already_killed(args: argparse.Namespace) -> bool:
    """True after the first kill (a marker file per rank), so the restarted group trains on."""
    marker = Path(args.log_dir or tempfile.gettempdir()) / f"killed-group{args.group}-rank{os.environ['RANK']}"
    if marker.exists():
        return True
    marker.write_text("killed")
    return False


def simulate(args: argparse.Namespace) -> None:
    """Start a lighthouse and `--groups` torchrun jobs on this machine, then summarise."""
    require_scikit_learn()  # before any group starts: its ranks would each fail on it
    log_dir = Path(tempfile.mkdtemp(prefix="shardkit-ft-"))
    bin_dir = Path(sys.executable).parent
    lighthouse = subprocess.Popen(
        [str(bin_dir / "torchft_lighthouse"), "--min_replicas", "1", "--bind",
         f"127.0.0.1:{args.lighthouse_port}", "--join_timeout_ms", "1000",
         "--heartbeat_timeout_ms", "2000"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {**os.environ, "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{args.lighthouse_port}",
           "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}
    groups = []
    try:
        for group in range(args.groups):
            groups.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                 "--max-restarts", "1", "--master-addr", "127.0.0.1",
                 "--master-port", str(args.lighthouse_port + 1 + group), __file__, "--train",
                 "--group", str(group), "--steps", str(args.steps), "--kill-at",
                 str(args.kill_at), "--kill-group", str(args.kill_group), "--log-dir",
                 str(log_dir), "--sleep", str(args.sleep), "--batch", str(args.batch)],
                env=env, stdout=subprocess.PIPE, text=True,
                stderr=(log_dir / f"group{group}.log").open("w")))
        for group, proc in enumerate(groups):
            out, _ = proc.communicate(timeout=600)
            print(out.strip())
            if proc.returncode:
                tail = (log_dir / f"group{group}.log").read_text(errors="replace").splitlines()[-15:]
                raise SystemExit("\n".join(tail) + f"\nreplica group {group} failed (exit "
                                 f"{proc.returncode}); its log: {log_dir}/group{group}.log")
    finally:
        lighthouse.kill()
        for proc in groups:
            if proc.poll() is None:
                proc.kill()
    summarise(log_dir, args)


def summarise(log_dir: Path, args: argparse.Namespace) -> None:
    """Print the survivors' stall and the killed group's time to rejoin, from the groups' logs."""
    records = {g: [json.loads(line) for line in (log_dir / f"group{g}.jsonl").read_text().splitlines()]
               for g in range(args.groups)}
    victim = records[args.kill_group]
    starts = [r["t"] for r in victim if r.get("event") == "start"]
    steps = [r for r in victim if "step" in r]
    died = max(r["t"] for r in steps if r["t"] < starts[-1]) if len(starts) > 1 else None
    for g, recs in records.items():
        if g == args.kill_group or died is None:
            continue
        times = sorted(r["s"] for r in recs if "s" in r)
        worst = max(r["s"] for r in recs if "s" in r and died - 1 <= r["t"] <= died + 10)
        alone = sorted({r["groups"] for r in recs if "groups" in r})
        print(f"group {g}: never restarted; typical step {times[len(times) // 2]:.3f} s, "
              f"slowest around the failure {worst:.2f} s; groups per step seen: {alone}")
    if died is not None:
        back = [r for r in steps if r["t"] > starts[-1] and r["committed"] and r["groups"] == args.groups]
        said = (f"group {args.kill_group}: died at step {args.kill_at}, relaunched "
                f"{starts[-1] - died:.1f} s later, ")
        if back:
            print(said + f"training with the others again after {back[0]['t'] - died:.1f} s "
                         f"(from step {back[0]['step']})")
        else:  # a loaded machine: the others finished before it was back (nothing went wrong)
            after = [r for r in steps if r["t"] > starts[-1] and r["committed"]]
            print(said + "and did not train with the others again: they had finished their "
                         f"{args.steps} steps before it was back ({len(after)} steps committed "
                         "after its relaunch; more --steps or a larger --sleep give it time)")
    finals = {g: recs[-1]["loss"] for g, recs in records.items() if "loss" in recs[-1]}
    print(f"last losses per group: {finals}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", action="store_true", help="be one rank of one group (torchrun)")
    ap.add_argument("--group", type=int, default=0)
    ap.add_argument("--groups", type=int, default=3)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    ap.add_argument("--kill-group", type=int, default=2)
    ap.add_argument("--kill-at", type=int, default=30, help="step at which --kill-group dies (-1: never)")
    ap.add_argument("--sleep", type=float, default=0.05)
    ap.add_argument("--log-dir", default="")
    ap.add_argument("--lighthouse-port", type=int, default=29610)
    args = ap.parse_args()
    train(args) if args.train else simulate(args)


if __name__ == "__main__":
    main()
