"""Global-norm gradient clipping over the shards of a sharded model."""

from __future__ import annotations

import torch
from torch import nn

from .module_api import get_state
from .torch_norms import counted_rows, total_norm_of
from ..step.whole_view import local_of


def clip_grad_norm_(module: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale all gradients so their global norm is at most max_norm; return the global norm.

    The same answer as torch.nn.utils.clip_grad_norm_(module.parameters(), ...) on the unsharded
    model: each gradient shard's norm becomes its whole parameter's over the shard group (and
    tensor parallelism's group, where TP splits it: sharding/surface/torch_norms.py), then torch
    combines them.
    """
    state = get_state(module)
    params = [sp for sp in state.iter_params() if sp.sharded.grad is not None]
    with torch.no_grad():
        total = total_norm_of([counted_rows(sp.sharded.grad, sp, state) for sp in params],
                              [(state, sp.tp_group) for sp in params], norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in (local_of(sp.sharded.grad) for sp in params):
        g.detach().mul_(coef.to(g.device, g.dtype))
    return total
