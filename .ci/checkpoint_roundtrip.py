"""Wheel smoke: a 2-rank sharded save, `shardkit inspect` on it, and a 1-rank load that must give back the saved weights.

Run by `.ci/wheel-smoke` with the installed wheel (not the checkout) on sys.path.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

import torch

import shardkit


def build_model() -> torch.nn.Module:
    """A small MLP with the same initial weights on every rank and in every run."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def train_and_save(rank: int, path: str) -> dict[str, torch.Tensor]:
    """One SGD step at 2 ranks, then save; rank 0 returns the full weights that were saved."""
    model = shardkit.shard(build_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    torch.manual_seed(1 + rank)
    model(torch.randn(4, 8)).square().sum().backward()
    opt.step()
    full = shardkit.checkpoint.full_state_dict(model)
    shardkit.checkpoint.save(path, model, opt, extra={"step": 1})
    return full


def load(rank: int, path: str) -> tuple[dict[str, torch.Tensor], object]:
    """Load the checkpoint at 1 rank; return the full weights and the `extra` that was saved."""
    model = shardkit.shard(build_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    extra = shardkit.checkpoint.load(path, model, opt)
    return shardkit.checkpoint.full_state_dict(model), extra


def main() -> int:
    """Save at 2 ranks, inspect offline, load at 1 rank, compare; exit 0 only when all agree."""
    with tempfile.TemporaryDirectory(prefix="shardkit-smoke-") as tmp:
        path = f"{tmp}/ckpt"
        saved = shardkit.spawn(train_and_save, 2, path, backend="cpu")[0]
        text = subprocess.run(["shardkit", "inspect", "--json", path], check=True,
                              capture_output=True, text=True).stdout
        info = json.loads(text)
        print(subprocess.run(["shardkit", "inspect", path], check=True, capture_output=True,
                             text=True).stdout)
        loaded, extra = shardkit.spawn(load, 1, path, backend="cpu")[0]
    initial = build_model().state_dict()
    assert info["world_size"] == 2, info
    assert sorted(saved) == sorted(loaded) == sorted(initial), (sorted(saved), sorted(loaded))
    for name, tensor in saved.items():
        assert not torch.equal(tensor, initial[name]), f"{name}: the training step changed nothing"
        assert torch.equal(tensor, loaded[name]), f"{name}: loaded weights differ from the saved ones"
    assert extra == {"step": 1}, extra
    print(f"checkpoint round trip: {len(saved)} tensors saved at 2 ranks, loaded at 1, identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
