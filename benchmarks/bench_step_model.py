"""The step-time model (shardkit/planner/steptime.py) against measured shardkit steps, same run.

1. Compute per unit: the model unsharded in this process, one thread (what each rank gets),
   forward / backward per unit and the optimizer step, medians (planner/compute_times.py).
2. The link: gloo all-gathers and reduce-scatters through shardkit's cpu backend at --nproc
   ranks, sizes 64 KiB to 16 MiB; alpha and beta fitted to the all-gathers (least squares on
   time / (p - 1) = alpha + bytes / beta), the reduce-scatters' factor over the same line.
3. Prediction: shardkit.plan at --nproc ranks per strategy, scheduled by steptime.step_time
   with and without overlap (host-bound: on CPU the hooks run when compute lets them).
4. Measurement: the same model, batch and strategy trained by shardkit at --nproc ranks, one
   thread each; median step (forward, backward, optimizer) of the slowest rank.

    python benchmarks/bench_step_model.py --model gpt2-small --batch 2 --seq 128 --nproc 2

Run it on as many idle cores as ranks: ranks that share a core measure the sharing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_step import build, loss_of, make_batches

import shardkit
from shardkit.planner.compute_times import measure_unit_times
from shardkit.planner.steptime import Link, Topology, step_time
from shardkit.sharding.setup.plan import plan_units
from shardkit.wrap import as_policy, transformer_layers

SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]


def link_rank(rank: int, sizes: list[int], repeats: int) -> dict:
    """Median seconds of the cpu backend's all-gather and reduce-scatter per input size."""
    torch.set_num_threads(1)
    ctx = shardkit.init()
    backend, group = ctx.backend, ctx.world
    out: dict[str, list[float]] = {"all_gather": [], "reduce_scatter": []}
    for nbytes in sizes:
        numel = nbytes // 4
        shard = torch.randn(numel)
        gathered = torch.empty(numel * group.size)
        for kind in out:
            times = []
            for _ in range(repeats + 1):
                backend.barrier(group)
                began = time.perf_counter()
                if kind == "all_gather":
                    backend.all_gather_into_tensor(gathered, shard, group).wait()
                else:
                    backend.reduce_scatter_tensor(shard, gathered.clone(), group).wait()
                times.append(time.perf_counter() - began)
            out[kind].append(statistics.median(times[1:]))
    return out


def fit_link(sizes: list[int], ranks: list[dict], world: int) -> Link:
    """Alpha, beta from the all-gathers (slowest rank per size), the reduce-scatter factor."""
    gather = [max(r["all_gather"][i] for r in ranks) / (world - 1) for i in range(len(sizes))]
    reduce = [max(r["reduce_scatter"][i] for r in ranks) / (world - 1) for i in range(len(sizes))]
    n = len(sizes)
    mean_x, mean_y = sum(sizes) / n, sum(gather) / n
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in zip(sizes, gather))
             / sum((x - mean_x) ** 2 for x in sizes))
    alpha = max(mean_y - slope * mean_x, 0.0)
    line = [alpha + slope * x for x in sizes]
    factor = statistics.median(r / g for r, g in zip(reduce, line))
    return Link("gloo-measured", alpha, 1.0 / slope, factor)


def train_rank(rank: int, name: str, batch: int, seq: int, strategy: str, steps: int,
               warmup: int) -> float:
    """Median seconds per training step on this rank."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, classes = build(name)
    model = shardkit.shard(model, strategy=strategy, auto_wrap_policy=transformer_layers(set(classes)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    batches = make_batches(name, model, batch, seq, rank, "cpu")
    times = []
    for step in range(warmup + steps):
        x, y = batches[step % len(batches)]
        began = time.perf_counter()
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        if step >= warmup:
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2-small")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--strategies", default="FULL_SHARD,SHARD_GRAD_OP,NO_SHARD")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    torch.manual_seed(0)
    model, classes = build(args.model)
    policy = transformer_layers(set(classes))
    units = [u.module for u in plan_units(model, as_policy(policy))]
    x, y = make_batches(args.model, model, args.batch, args.seq, 0, "cpu")[0]
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)

    def optimizer_step() -> None:
        opt.step()
        opt.zero_grad()
    times = measure_unit_times(units, lambda: loss_of(model, x, y), optimizer_step, repeats=3)
    link = fit_link(SIZES, shardkit.spawn(link_rank, args.nproc, SIZES, 5), args.nproc)
    print(f"compute at 1 rank: forward {sum(times.forward_s):.3f} s, backward "
          f"{sum(times.backward_s):.3f} s, optimizer {times.optimizer_s:.3f} s")
    print(f"link (gloo, {args.nproc} ranks): alpha {link.latency_s * 1e6:.0f} us, beta "
          f"{link.bandwidth / 1e9:.2f} GB/s, reduce-scatter x{link.reduce_scatter_factor:.2f}")
    topology = Topology(link, link, args.nproc)
    with torch.device("meta"):
        meta, _ = build(args.model)
    rows = []
    for strategy in args.strategies.split(","):
        plan = shardkit.plan(meta, args.nproc, strategy=strategy, auto_wrap_policy=policy,
                             backend="cpu")
        predicted = step_time(plan, times, topology, host_bound=True)
        measured = max(shardkit.spawn(train_rank, args.nproc, args.model, args.batch, args.seq,
                                      strategy, args.steps, args.warmup))
        rows.append({"strategy": strategy, "measured_s": measured,
                     "serial_s": predicted.serial_s, "overlapped_s": predicted.overlapped_s,
                     "compute_s": predicted.compute_s, "communication_s": predicted.communication_s})
    print(f"\n{args.model}, batch {args.batch} x seq {args.seq}, {args.nproc} ranks, torch "
          f"{torch.__version__}")
    print("| strategy | measured s/step | predicted serial | ratio | predicted overlapped | ratio |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['strategy']} | {r['measured_s']:.3f} | {r['serial_s']:.3f} | "
              f"{r['serial_s'] / r['measured_s']:.2f} | {r['overlapped_s']:.3f} | "
              f"{r['overlapped_s'] / r['measured_s']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"link": link.__dict__, "rows": rows, "args": vars(args)}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
