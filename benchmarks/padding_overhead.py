"""Padding of dim-0 row shards against the flat 1-D shards they replaced, for real model shapes.

Pure arithmetic on meta-device models (nothing is allocated): for each model and world size, the
elements every rank holds (shard_numel summed over distinct parameters) with shardkit's row
layout and with the flat layout (ceil(numel / N) per rank), and the padding each adds over the
parameters' real size. Needs transformers (pip install -e '.[hf]'): configs only, no download.

    python benchmarks/padding_overhead.py --models gpt2,llama --ranks 8,64
"""

from __future__ import annotations

import argparse
import subprocess

import torch

from shardkit.planner.models import from_hf_config, hf_config
from shardkit.sharding.step.layout import shard_layout


def per_rank_elements(model: torch.nn.Module, ranks: int) -> tuple[int, int, int]:
    """(real elements / ranks, rounded up; row-layout elements per rank; flat-layout elements per rank)."""
    params = {id(p): p for p in model.parameters()}.values()  # tied weights once
    total = sum(p.numel() for p in params)
    rows = sum(shard_layout(p.shape, ranks).shard_numel for p in params)
    flat = sum(shard_layout(p.numel(), ranks).shard_numel for p in params)
    return -(-total // ranks), rows, flat


def main() -> None:
    """Print one table row per model and world size."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2,llama", help="transformers model types")
    ap.add_argument("--ranks", default="8,64")
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "?"
    print(f"torch {torch.__version__}, commit {commit}; elements per rank (fp32: x4 bytes)")
    print("| model | params | ranks | ideal/rank | flat/rank (pad %) | rows/rank (pad %) |")
    print("|---|---|---|---|---|---|")
    for name in args.models.split(","):
        model = from_hf_config(hf_config(name))
        count = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        for n in (int(r) for r in args.ranks.split(",")):
            ideal, rows, flat = per_rank_elements(model, n)
            print(f"| {name} | {count:,} | {n} | {ideal:,} | {flat:,} ({100 * (flat / ideal - 1):.3f}) "
                  f"| {rows:,} ({100 * (rows / ideal - 1):.3f}) |")


if __name__ == "__main__":
    main()
