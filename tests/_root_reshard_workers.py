"""Rank bodies for tests/test_root_reshard.py (importable, so shardkit.spawn can pickle them)."""

from __future__ import annotations

import copy

import torch
from torch import nn

import shardkit
from shardkit.sharding.surface.module_api import get_state


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


def build() -> nn.Module:
    """Embedding-like input and output layers in the root (as a language model's), two blocks."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), Block(32), Block(32), nn.Linear(32, 8))


def root_after_forward(rank: int, root_value: object) -> dict:
    """The root unit's state after a training forward and an eval forward, bytes sent per step,
    and losses against the unsharded model trained on the global batch."""
    ctx = shardkit.current_context()
    reference = build()
    spec = None if root_value == "default" else {"<root>": root_value}
    model = shardkit.shard(copy.deepcopy(reference), auto_wrap_policy=shardkit.wrap.transformer_layers({Block}),
                           reshard_after_forward=spec)
    root = get_state(model).root_unit
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    out = {"after_train_forward": [], "after_eval_forward": [], "sent": [], "losses": [], "ref": []}
    for step in range(3):
        data = torch.Generator().manual_seed(step)
        x_all = torch.randn(2 * ctx.world_size, 8, generator=data)
        x = x_all[2 * ctx.rank:2 * ctx.rank + 2]
        shardkit.comm_stats(model, reset=True)
        loss = model(x).square().mean()
        out["after_train_forward"].append(root.sharded_state.value)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["sent"].append(shardkit.comm_stats(model)["all_gather"])
        out["losses"].append(shardkit.global_mean(loss))
        ref_loss = reference(x_all).square().mean()
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        out["ref"].append(ref_loss.item())
        with torch.no_grad():
            model(x)
        out["after_eval_forward"].append(root.sharded_state.value)
    out["root_gather_bytes"] = sum(sp.padded_numel * sp.compute_dtype.itemsize
                                   for sp in root.params) * (ctx.world_size - 1) // ctx.world_size
    return out
