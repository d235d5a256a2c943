"""Overhead of collective-order verification (shard(verify=True) / SHARDKIT_DEBUG=1).

Two copies of one model are sharded in the same ranks, one verified and one not, and trained on
alternating steps (interleaved A/B, so machine noise hits both alike). Prints the median seconds
per step of each and their ratio, with the machine, torch version and commit.

    python benchmarks/bench_verify.py --nproc 2 --steps 20 --blocks 8 --dim 256
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import subprocess
import time

import torch
import torch.nn.functional as F
from torch import nn

import shardkit


class Block(nn.Module):
    """Linear + LayerNorm residual block (one sharding unit)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x + norm(tanh(lin(x)))."""
        return x + self.norm(torch.tanh(self.lin(x)))


def _net(dim: int, blocks: int) -> nn.Module:
    return nn.Sequential(*[Block(dim) for _ in range(blocks)], nn.Linear(dim, 10))


def bench_rank(rank: int, dim: int, blocks: int, steps: int, warmup: int) -> dict:
    """Time interleaved steps of a verified and an unverified copy; return per-step seconds."""
    torch.manual_seed(0)
    base = _net(dim, blocks)
    policy = shardkit.wrap.transformer_layers({Block})
    models = {"off": shardkit.shard(copy.deepcopy(base), auto_wrap_policy=policy, verify=False),
              "on": shardkit.shard(copy.deepcopy(base), auto_wrap_policy=policy, verify=True)}
    opts = {k: torch.optim.Adam(m.parameters(), lr=1e-3) for k, m in models.items()}
    times: dict[str, list[float]] = {"off": [], "on": []}
    ctx = shardkit.current_context()
    for step in range(warmup + steps):
        x = torch.randn(32, dim, generator=torch.Generator().manual_seed(step * 100 + rank))
        y = torch.randint(0, 10, (32,), generator=torch.Generator().manual_seed(step))
        for key in (("off", "on") if step % 2 else ("on", "off")):
            ctx.barrier()
            t = time.perf_counter()
            F.cross_entropy(models[key](x), y).backward()
            opts[key].step()
            opts[key].zero_grad()
            ctx.barrier()
            if step >= warmup:
                times[key].append(time.perf_counter() - t)
    verified = models["on"]._shardkit_state.backend.verified_collectives
    return {"times": times, "verified_collectives": verified}


def main() -> None:
    """Run the benchmark and print one markdown table row set."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args()
    results = shardkit.spawn(bench_rank, a.nproc, a.dim, a.blocks, a.steps, a.warmup,
                             threads_per_rank=1)
    off = statistics.median(results[0]["times"]["off"])
    on = statistics.median(results[0]["times"]["on"])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=os.path.dirname(__file__)).stdout.strip()
    per_step = results[0]["verified_collectives"] / (a.warmup + a.steps)
    print(f"machine: {platform.node()} ({os.cpu_count()} cores), torch {torch.__version__}, "
          f"commit {commit}; {a.nproc} ranks, cpu/gloo, {a.blocks} blocks of dim {a.dim}, "
          f"{per_step:.0f} collectives per step")
    print("| mode | median s/step | ratio |\n|---|---|---|")
    print(f"| verify off | {off:.4f} | 1.00 |\n| verify on | {on:.4f} | {on / off:.2f} |")


if __name__ == "__main__":
    main()
