"""The sharding engine: per-parameter shards, per-unit flat collectives, hook-driven runtime.

Three rooms and the entry point: api (shard(), five named steps), setup/ (what runs once inside
shard(): the unit plan, groups, reshard values, meta init, cross-rank checks), step/ (what runs
every training step: state, units, parameters, hooks, collectives, the compiled-graph ops), and
surface/ (what a sharded model offers training code: no_sync and unshard, full tensors, views for
checkpoints, clipping, state_dict). Imports run api -> setup -> surface -> step, never back; each
room's __init__ lists its files. Beside them, two leaves every room reads: policies (strategy,
MixedPrecision, Quantization, FaultTolerance, the frozen config) and wrap_policies (which
modules become units: shardkit.wrap.*).
"""

from .api import shard
from .surface.clip import clip_grad_norm_
from .surface.fault_tolerant import fault_tolerant_optimizer
from .surface.forward_methods import register_forward_method
from .surface.local_step import elementwise_optimizer
from .surface.module_api import ShardedModule, get_state
from .surface.param_access import full_shape, full_tensor, local_shard
from .policies import FaultTolerance, MixedPrecision, Quantization, ShardingStrategy
from .surface.views import (ShardView, iter_unit_full_params, load_full_param_, shard_views, sharding_info)


def comm_stats(model, reset: bool = False) -> dict:
    """Bytes this rank sent through the backend per collective kind since the last reset."""
    stats = get_state(model).stats
    snapshot = stats.snapshot()
    if reset:
        stats.reset()
    return snapshot


__all__ = ["FaultTolerance", "MixedPrecision", "Quantization", "ShardView", "ShardedModule", "ShardingStrategy", "clip_grad_norm_",
           "comm_stats", "get_state", "iter_unit_full_params", "load_full_param_", "shard",
           "shard_views", "sharding_info"]
__all__ += ["register_forward_method", "full_shape", "full_tensor", "local_shard",
            "fault_tolerant_optimizer", "elementwise_optimizer"]
