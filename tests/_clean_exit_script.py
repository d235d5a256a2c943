"""One rank that trains and ends without shardkit.shutdown() (as under Lightning's Trainer);
prints whether torch's process group was still up when its last exit function ran."""

from __future__ import annotations

import atexit
import sys

import torch
import torch.distributed as dist


def _report() -> None:  # registered before init(): runs after shardkit's exit handlers
    sys.stdout.write(f"process group at the end: {'up' if dist.is_initialized() else 'destroyed'}\n")


atexit.register(_report)

import shardkit  # noqa: E402 - after the hook, on purpose

shardkit.init()
torch.manual_seed(0)
model = shardkit.shard(torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)]),
                       auto_wrap_policy=lambda m: isinstance(m, torch.nn.Linear))
opt = torch.optim.AdamW(model.parameters())
for _ in range(3):
    model(torch.ones(4, 32)).sum().backward()
    opt.step()
    opt.zero_grad()
