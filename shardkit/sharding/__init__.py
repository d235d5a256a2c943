"""The sharding engine: per-parameter shards, per-unit flat collectives, hook-driven runtime."""

from .api import shard
from .clip import clip_grad_norm_
from .module_api import ShardedModule, get_state
from .policies import MixedPrecision, ShardingStrategy
from .views import (ShardView, iter_unit_full_params, load_full_param_, shard_views,
                    sharding_info)


def comm_stats(model, reset: bool = False) -> dict:
    """Bytes this rank sent through the backend per collective kind since the last reset."""
    stats = get_state(model).stats
    snapshot = stats.snapshot()
    if reset:
        stats.reset()
    return snapshot


__all__ = ["MixedPrecision", "ShardView", "ShardedModule", "ShardingStrategy", "clip_grad_norm_",
           "comm_stats", "get_state", "iter_unit_full_params", "load_full_param_", "shard",
           "shard_views", "sharding_info"]
