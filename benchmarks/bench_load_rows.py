"""Peak host memory of loading full safetensors weights into a meta-initialised sharded model.

A model whose embedding dominates (a language model's: `--vocab` x `--width` fp32) is exported as
Hugging Face's layout (split files + index), then loaded by `--nproc` CPU ranks with
`shardkit.checkpoint.load_full_state_dict` two ways in fresh processes: `rows` (what it does: each
rank asks the file for only its rows of each tensor, a slice) and `whole` (each rank asks for every
whole tensor and copies its rows out: the loader before, which relied on safetensors mapping the
file so that untouched rows are never read). Printed: each rank's peak RSS
growth during the load (MiB), next to the largest tensor's size and a rank's shard of the model.

    python benchmarks/bench_load_rows.py --nproc 2 --vocab 400000 --width 256
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile

import torch
from torch import nn

import shardkit
import shardkit.checkpoint as ck
import shardkit.checkpoint.full as full_module


class Embedder(nn.Module):
    """A large embedding and a small head."""

    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: (batch, tokens)."""
        return self.head(self.embed(ids))


def _rank(rank: int, folder: str, vocab: int, width: int, how: str) -> float:
    opened = full_module.read_full_source

    def whole_tensors(source):
        shapes, read = opened(source)
        return shapes, lambda name, span: (read(name, None) if span is None
                                           else read(name, None)[span[0]:span[1]])

    with torch.device("meta"):
        model = Embedder(vocab, width)
    model = shardkit.shard(model, auto_wrap_policy=lambda m: isinstance(m, nn.Embedding))
    before = _resident_kib()
    with open("/proc/self/clear_refs", "w") as f:  # Linux: the peak (VmHWM) restarts from now
        f.write("5")
    if how == "whole":
        full_module.read_full_source = whole_tensors
    ck.load_full_state_dict(model, folder)
    return (_peak_kib() - before) / 1024


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _resident_kib() -> int:
    return _status_kib("VmRSS")


def _peak_kib() -> int:
    return _status_kib("VmHWM")


def main() -> None:
    """Export once, then load both ways in fresh processes; print the peak RSS growth per rank."""
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--vocab", type=int, default=400_000)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--how", choices=("rows", "whole"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.how:  # one fresh process per way: one way's peak must not hide the other's
        grown = shardkit.spawn(_rank, args.nproc, args.folder, args.vocab, args.width, args.how,
                               threads_per_rank=1)
        print(" ".join(f"{g:.0f}" for g in grown))
        return
    embed_mib = args.vocab * args.width * 4 / 2**20
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        model = Embedder(args.vocab, args.width)
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                  os.path.join(folder, "model.safetensors"))
        del model
        print(f"embedding {embed_mib:.0f} MiB fp32 (the largest tensor); a rank's shard of the "
              f"model {embed_mib / args.nproc:.0f} MiB at {args.nproc} ranks")
        for how in ("rows", "whole"):
            out = subprocess.run([sys.executable, __file__, "--nproc", str(args.nproc), "--vocab",
                                  str(args.vocab), "--width", str(args.width), "--how", how,
                                  "--folder", folder], capture_output=True, text=True, check=True)
            print(f"{how:5s}: peak RSS growth per rank during the load (MiB): "
                  f"{out.stdout.strip().splitlines()[-1]}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, commit {commit}")


if __name__ == "__main__":
    main()
