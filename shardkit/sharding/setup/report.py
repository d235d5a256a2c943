"""What shard() did, as INFO lines on the "shardkit" logger: strategy, groups, units and sizes."""

from __future__ import annotations

import logging
import math

from torch import nn

from ...logs import logger
from ..step.state import ShardState


def log_sharding(model: nn.Module, state: ShardState) -> None:
    """Log the strategy and groups of a freshly sharded model, then one line per unit."""
    if not logger.isEnabledFor(logging.INFO):  # skip the walk over units when nobody listens
        return
    replica = state.replica_group.size if state.replica_group else 1
    logger.info("rank %d: sharded %s with %s over a shard group of %d rank(s) x %d replica(s): "
                "%d unit(s) on %s", state.world.rank, type(model).__name__, state.strategy_name,
                state.shard_group.size, replica, len(state.units), state.device)
    for unit in state.units:
        numel = sum(math.prod(sp.full_shape) for sp in unit.params)
        logger.info("rank %d: unit %r: %d parameter(s), %s elements (%s per rank)",
                    state.world.rank, unit.name, len(unit.params), f"{numel:,}",
                    f"{math.ceil(numel / state.shard_group.size):,}")
