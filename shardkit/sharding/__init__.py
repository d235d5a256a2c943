"""The sharding engine: per-parameter shards, per-unit flat collectives, hook-driven runtime.

Layout (one job per file): policies (strategy, MixedPrecision, config), plan (which module is a
unit, which unit owns each parameter), groups (shard / replicate groups, destroyed when their model dies), layout (a parameter's
dim-0 row split), param (one parameter's shard and gathered tensor), whole_view (the
DeviceMesh and the DTensor of the whole parameter training code sees; .item() of a partial
value refused), param_access (global
shape, full tensor and local rows of a sharded parameter, for training code), collectives
(fused copy-in, collective, fused copy-out; divide factors), buffers (flat-buffer reuse on
host-ordered devices), lifecycle (a unit's ShardedState / TrainingState machines), reshard
(per-unit reshard_after_forward values, k-rank groups), unit (the lifecycle transitions and the
reduce of one unit), state (per-model context, execution order, prefetch, backward finaliser),
hooks (module and autograd hooks), forward_methods (other methods run under the hooks),
reduce_ops (AVG / PREMUL_SUM or SUM + divide), materialize (meta-device init), replicas
(compare replicated values across ranks, or copy rank 0's), api (shard()), module_api
(no_sync, unshard, gradient sync, explicit prefetch; dtype/device changes refused), clip
(clip_grad_norm_), torch_norms (torch's clip_grad_norm_/get_total_norm see whole parameters),
state_dict_hooks (state_dict() tags and warns, load_state_dict() cuts a full dict to rows),
traffic (bytes sent), views (the checkpoint contract), trace (`shardkit::` profiler ranges, free
without a profiler).
"""

from .api import shard
from .clip import clip_grad_norm_
from .forward_methods import register_forward_method
from .module_api import ShardedModule, get_state
from .param_access import full_shape, full_tensor, local_shard
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
__all__ += ["register_forward_method", "full_shape", "full_tensor", "local_shard"]
