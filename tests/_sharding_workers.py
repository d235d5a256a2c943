"""Per-rank worker functions for the sharding tests (module-level so shardkit.spawn can pickle them)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import shardkit
from shardkit.sharding import iter_unit_full_params

from _models import Block, TinyNet, batch, global_batch

STEPS = 5


def full_params(model) -> dict[str, torch.Tensor]:
    """Gather every parameter of a sharded model (collective), keyed by original name."""
    out: dict[str, torch.Tensor] = {}
    for _, tensors in iter_unit_full_params(model):
        out.update({k: v.clone() for k, v in tensors.items()})
    return out


def max_diff(full: dict[str, torch.Tensor], ref: torch.nn.Module) -> float:
    """Largest absolute difference between gathered params and a reference model's params."""
    return max((full[k].float() - p.detach().float()).abs().max().item()
               for k, p in ref.named_parameters())


def parity_run(rank: int, strategy: str, world: int, shard_kwargs: dict | None = None,
               seed: int = 0, lr: float = 1e-2) -> list[float]:
    """Train TinyNet sharded and unsharded (on the global batch) side by side; per-step max diffs."""
    torch.manual_seed(seed)
    ref = TinyNet()
    model = copy.deepcopy(ref)
    model = shardkit.shard(model, strategy=strategy,
                           auto_wrap_policy=shardkit.wrap.transformer_layers({Block}),
                           **(shard_kwargs or {}))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr)
    diffs = []
    for step in range(STEPS):
        x, y = batch(step, rank)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        gx, gy = global_batch(step, world)
        F.cross_entropy(ref(gx), gy).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        diffs.append(max_diff(full_params(model), ref))
    return diffs


def api_checks(rank: int, world: int) -> dict:
    """Names, shapes, views contract and load_full_param_ of a sharded TinyNet, as plain data."""
    from shardkit.sharding import load_full_param_, shard_views, sharding_info

    torch.manual_seed(0)
    ref = TinyNet()
    names = [n for n, _ in ref.named_parameters()]
    keys = list(ref.state_dict())
    model = shardkit.shard(copy.deepcopy(ref), auto_wrap_policy=shardkit.wrap.transformer_layers({Block}))
    out: dict = {"names_same": [n for n, _ in model.named_parameters()] == names,
                 "keys_same": list(model.state_dict()) == keys,
                 "all_1d": all(p.dim() == 1 for p in model.parameters()),
                 "info": sharding_info(model), "views": []}
    for v in shard_views(model):
        full = dict(ref.named_parameters())[v.fqn].detach().reshape(-1)
        mine = v.param.detach()
        out["views"].append({
            "fqn": v.fqn, "numel": full.numel(), "shard_numel": v.shard_numel, "offset": v.offset,
            "valid": v.valid_numel, "shape_ok": v.full_shape == dict(ref.named_parameters())[v.fqn].shape,
            "slice_ok": torch.equal(mine[:v.valid_numel], full[v.offset:v.offset + v.valid_numel]),
            "pad_zero": bool((mine[v.valid_numel:] == 0).all()),
            "is_param": any(v.param is p for p in model.parameters()),
            "group": (v.shard_group.size, v.replica_group is None), "dtype": v.dtype})
    # load_full_param_: write a new full tensor, read it back through a gather.
    target = torch.arange(ref.head.weight.numel(), dtype=torch.float32).reshape(ref.head.weight.shape)
    before = model.get_parameter("head.weight")
    load_full_param_(model, "head.weight", target)
    out["load_same_object"] = model.get_parameter("head.weight") is before
    out["load_roundtrip"] = torch.equal(full_params(model)["head.weight"], target)
    return out
