"""Rank bodies for tests/test_newcomer_frictions.py (importable, so shardkit.spawn can pickle them)."""

from __future__ import annotations

import torch
from torch import nn

import shardkit
from shardkit import checkpoint


def global_means(rank: int) -> dict:
    """Each rank holds rank + 1: as a float, a 0-d tensor and a one-element float32 tensor."""
    ctx = shardkit.current_context()
    out = {"float": shardkit.global_mean(float(rank + 1)),
           "tensor": shardkit.global_mean(torch.tensor(rank + 1.0)),
           "float32_1": shardkit.global_mean(torch.tensor([rank + 1.0], dtype=torch.float32)),
           "launcher": ctx.env.launcher}
    try:
        shardkit.global_mean(torch.ones(2))
    except shardkit.ShardkitError as exc:
        out["error"] = str(exc)
    return out


def save_with_extra(rank: int, path: str) -> str:
    """A 2-rank sharded save whose `extra` a later process reads without a model."""
    torch.manual_seed(0)
    model = shardkit.shard(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    sched.step()
    return checkpoint.save(path, model, opt, extra={"epoch": 3, "scheduler": sched.state_dict()})
