"""shardkit: one sharded data-parallel engine for PyTorch that runs the same way on every accelerator."""

from ._version import __version__
from .logs import configure_from_env as _configure_logging
from .backend import API_VERSION, Backend
from .capabilities import Capabilities
from .errors import (BackendNotFoundError, BackendUnavailableError, PluginLoadError,
                     ShardkitError, UnsupportedOperationError)
from .handles import CompletedWork, Group, NullEvent, NullStream, ReduceOp, TorchWork, Work
from .launch_env import LaunchEnv, detect_launch_env
from .plugin import hookimpl, hookspec
from .plugin.manager import register_plugin
from .runtime import DistContext, current_context, init, shutdown
from .selection import backend_statuses, get_backend
from .spawn import spawn
from .replicate import replicate
from . import checkpoint, wrap
from .sharding import (MixedPrecision, ShardingStrategy, clip_grad_norm_, comm_stats, shard)
from .planner import Plan, plan
from .sharding import register_forward_method
from .sharding import full_shape, full_tensor, local_shard
from .sharding.replicas import check_model_replicas as check_replicas
from .seeding import seeded
# Every error class the README names, importable from one place (shardkit.spawn is the function).
from .errors import PeerFailedError
from .spawn import SpawnError
from .rendezvous import JobStoreError
from .sharding.verify import CollectiveOrderError
from .checkpoint.errors import (CheckpointError, CheckpointNotFoundError, CorruptCheckpointError,
                                IncompleteCheckpointError, StateDictMismatchError)

__all__ = [
    "API_VERSION", "Backend", "BackendNotFoundError", "BackendUnavailableError", "Capabilities",
    "CompletedWork", "DistContext", "Group", "LaunchEnv", "NullEvent", "NullStream",
    "PluginLoadError", "ReduceOp", "ShardkitError", "TorchWork", "UnsupportedOperationError",
    "Work", "__version__", "backend_statuses", "current_context", "detect_launch_env",
    "get_backend", "hookimpl", "hookspec", "init", "register_plugin",
    "shutdown", "spawn", "replicate",
    "MixedPrecision", "ShardingStrategy", "clip_grad_norm_", "comm_stats", "shard", "wrap",
    "checkpoint", "Plan", "plan",
]
__all__ += ["register_forward_method", "full_shape", "full_tensor", "local_shard",
            "check_replicas", "seeded"]
__all__ += ["PeerFailedError", "SpawnError", "JobStoreError", "CollectiveOrderError",
            "CheckpointError", "CheckpointNotFoundError", "CorruptCheckpointError",
            "IncompleteCheckpointError", "StateDictMismatchError"]

_configure_logging()  # SHARDKIT_LOG=debug|info prints the "shardkit" logger to stderr
