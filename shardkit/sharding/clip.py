"""Global-norm gradient clipping over the shards of a sharded model."""

from __future__ import annotations

import math

import torch
from torch import nn

from .module_api import get_state


def _local_shard_grads(module: nn.Module) -> list[torch.Tensor]:
    state = get_state(module)
    return [sp.sharded.grad for sp in state.iter_params() if sp.sharded.grad is not None]


def clip_grad_norm_(module: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale all gradients so their global norm is at most max_norm; return the global norm.

    Each rank takes the norm of its own shards (padding is zero, so it adds nothing) and the shard
    group combines them: sum of |g|^p for finite p, the largest value for the inf-norm. Replicas hold
    identical shards, so the replica group is not included.
    """
    state = get_state(module)
    be, group = state.backend, state.shard_group
    grads = _local_shard_grads(module)
    norm_type = float(norm_type)
    device = state.device
    if math.isinf(norm_type):
        local = torch.zeros((), dtype=torch.float32, device=device)
        for g in grads:
            local = torch.maximum(local, g.detach().abs().max().to(device, torch.float32))
        # Collectives are asked only for sums, so gather every rank's maximum and take it here.
        everyone = torch.empty(group.size, dtype=torch.float32, device=device)
        be.all_gather_into_tensor(everyone, local.reshape(1), group).wait()
        total = everyone.max()
    else:
        local = torch.zeros((), dtype=torch.float32, device=device)
        for g in grads:
            local = local + g.detach().to(device, torch.float32).abs().pow(norm_type).sum()
        local = local.reshape(1)
        be.all_reduce(local, group, op="sum").wait()
        total = local[0].pow(1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(coef.to(g.device, g.dtype))
    return total
