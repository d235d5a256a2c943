"""shardkit.fault_tolerant_optimizer: the optimizer of a model sharded with fault_tolerance=.

The model's replica-group Manager lives on its engine state (fault_tolerance/cross_groups.py,
made by shard()); this finds it and hands the optimizer to fault_tolerance/optimizer.py.
"""

from __future__ import annotations

import torch

from ...errors import ShardkitError
from ...fault_tolerance.optimizer import FaultTolerantOptimizer, wrap
from .module_api import get_state


def fault_tolerant_optimizer(model: torch.nn.Module,
                             optimizer: torch.optim.Optimizer) -> FaultTolerantOptimizer:
    """Wrap `optimizer` of a model sharded with fault_tolerance= so steps commit only across a quorum."""
    cross = get_state(model).cross_groups
    if cross is None:
        raise ShardkitError("fault_tolerant_optimizer() needs a model sharded with "
                            "shardkit.shard(model, strategy='hybrid_shard', fault_tolerance="
                            "shardkit.FaultTolerance(replica_group=N, ...))")
    return wrap(cross, optimizer)
