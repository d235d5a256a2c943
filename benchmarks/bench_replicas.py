"""What shard()'s replica comparison and sync_module_states cost, next to a training step.

GPT-2-small shape (transformers GPT2LMHeadModel, 124M, unit = GPT2Block) on `--nproc` CPU ranks:
for NO_SHARD and FULL_SHARD, the seconds of `shardkit.check_replicas(model)` (what shard() runs
by default), of shard() with sync_module_states=True and with the default, and of one AdamW
training step of the same model in the same ranks (the peer the others are divided by).
Medians over `--reps`, slowest rank; machine, torch and commit printed beside them.

    python benchmarks/bench_replicas.py --nproc 2 --reps 3
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import subprocess
import time

import torch
import torch.nn.functional as F

import shardkit


def _gpt2_small():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0))


def _timed(fn) -> float:
    ctx = shardkit.current_context()
    ctx.barrier()
    start = time.perf_counter()
    fn()
    ctx.barrier()
    return time.perf_counter() - start


def bench_rank(rank: int, strategy: str, reps: int) -> dict:
    """Seconds for check_replicas, shard(default), shard(sync) and one training step."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    base = _gpt2_small()
    policy = shardkit.wrap.transformer_layers({GPT2Block})
    out: dict[str, list[float]] = {"shard (compare)": [], "shard (sync)": [], "check_replicas": [],
                                   "train step": []}
    model = None
    for _ in range(reps):
        for key, sync in (("shard (compare)", False), ("shard (sync)", True)):
            copied = copy.deepcopy(base)
            holder = {}
            out[key].append(_timed(lambda: holder.setdefault("m", shardkit.shard(
                copied, strategy=strategy, auto_wrap_policy=policy, sync_module_states=sync))))
            model = holder["m"]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 50257, (2, 128), generator=torch.Generator().manual_seed(rank))

    def step():
        F.cross_entropy(model(ids).logits.view(-1, 50257), ids.view(-1)).backward()
        opt.step()
        opt.zero_grad()

    step()  # warm-up: optimizer state
    for _ in range(reps):
        out["check_replicas"].append(_timed(lambda: shardkit.check_replicas(model)))
        out["train step"].append(_timed(step))
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    """Print one table per strategy."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--strategies", default="NO_SHARD,FULL_SHARD")
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "?"
    print(f"{platform.node()} ({platform.machine()}, {torch.get_num_threads()} threads here), "
          f"torch {torch.__version__}, commit {commit}, {args.nproc} ranks, GPT-2-small")
    for strategy in args.strategies.split(","):
        ranks = shardkit.spawn(bench_rank, args.nproc, strategy, args.reps, threads_per_rank=1)
        step = max(r["train step"] for r in ranks)
        print(f"\n{strategy}\n| what | s (slowest rank) | x train step |\n|---|---|---|")
        for key in ranks[0]:
            worst = max(r[key] for r in ranks)
            print(f"| {key} | {worst:.3f} | {worst / step:.3f} |")


if __name__ == "__main__":
    main()
