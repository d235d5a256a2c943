"""The cpu backend's all-gather and reduce-scatter against gloo's own, in the same rank processes.

gloo's flat all-gather and reduce-scatter stage every byte through an extra full-size buffer; the
cpu backend builds them from in-place broadcasts and an all-reduce instead. This measures both
ways on the same tensors, alternating, and prints medians and ratios with the machine, torch
version and commit (the figures quoted in backends/cpu/__init__.py and benchmarks/README.md).

    taskset -c 0,1 python benchmarks/bench_gloo.py --nproc 2 --numel 83000000 --reps 5
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import time

import torch
import torch.distributed as dist

import shardkit


def _timed(ctx, fn) -> float:
    ctx.barrier()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench_rank(rank: int, numel: int, reps: int) -> dict:
    """Median seconds of each collective done gloo's way and the backend's way."""
    ctx = shardkit.current_context()
    be, world = ctx.backend, ctx.world
    row = numel // world.size
    out = torch.empty(row * world.size)
    own = out[rank * row:(rank + 1) * row]
    own.normal_()
    full, scattered = torch.randn(row * world.size), torch.empty(row)
    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    cases = {
        "all_gather": (lambda: gather_single(out, own),
                       lambda: be.all_gather_into_tensor(out, own, world).wait()),
        "reduce_scatter": (lambda: scatter_single(scattered, full),
                           lambda: be.reduce_scatter_tensor(scattered, full, world).wait()),
    }
    times: dict[str, dict[str, list[float]]] = {k: {"gloo": [], "shardkit": []} for k in cases}
    for rep in range(reps + 1):  # the first round warms up
        for name, (theirs, ours) in cases.items():
            order = (("gloo", theirs), ("shardkit", ours))
            for label, fn in (order if rep % 2 else reversed(order)):
                elapsed = _timed(ctx, fn)
                if rep:
                    times[name][label].append(elapsed)
    return {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}


def main() -> None:
    """Run the benchmark and print a markdown table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--numel", type=int, default=83_000_000, help="fp32 elements per collective")
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    results = shardkit.spawn(bench_rank, a.nproc, a.numel, a.reps, threads_per_rank=1,
                             backend="cpu")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=os.path.dirname(__file__)).stdout.strip()
    print(f"machine: {platform.node()} ({os.cpu_count()} cores), torch {torch.__version__}, "
          f"commit {commit}; {a.nproc} ranks, {a.numel} fp32 elements, median of {a.reps}")
    print("| collective | gloo's own (ms) | cpu backend (ms) | ratio |\n|---|---|---|---|")
    for name in results[0]:
        theirs = max(r[name]["gloo"] for r in results) * 1e3
        ours = max(r[name]["shardkit"] for r in results) * 1e3
        print(f"| {name} | {theirs:.1f} | {ours:.1f} | {ours / theirs:.2f} |")


if __name__ == "__main__":
    main()
