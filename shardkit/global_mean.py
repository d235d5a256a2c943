"""`shardkit.global_mean`: one number every rank agrees on, for logging a loss or a metric.

Each rank's loss is the mean over its own batch, so printing rank 0's value logs a quarter of the
data at 4 ranks. Averaging across ranks is one all-reduce; it goes through the job's Backend
(SUM then a divide, since AVG is missing or inexact on some collective libraries) so it runs the
same on every backend, including device threads that share one process.
"""

from __future__ import annotations

import numbers

import torch

from .errors import ShardkitError
from .job.runtime import require_context


def global_mean(value: torch.Tensor | float) -> float:
    """Collective over every rank: the mean of `value` (a number or a one-element tensor) across ranks, as a float."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ShardkitError(
                f"shardkit.global_mean takes one number per rank, got a tensor of shape "
                f"{tuple(value.shape)}. HINT: reduce it first, e.g. global_mean(loss.mean())")
        local = value.detach().to(torch.float64)
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        local = torch.tensor(float(value), dtype=torch.float64)
    else:
        raise ShardkitError(f"shardkit.global_mean takes a number or a one-element tensor, got "
                            f"{type(value).__name__}")
    ctx = require_context()
    # float64 where the device has it, so 1,024 ranks' sum keeps a float32 loss's digits
    dtype = torch.float64 if ctx.backend.devices.supports_dtype(torch.float64) else torch.float32
    total = local.reshape(1).to(device=ctx.device, dtype=dtype)
    ctx.backend.collectives.all_reduce(total, ctx.world)
    return float(total.item()) / ctx.world_size
