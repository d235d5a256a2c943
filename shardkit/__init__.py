"""shardkit: one sharded data-parallel engine for PyTorch that runs the same way on every accelerator.

The public names resolve on first use (PEP 562), so `import shardkit` costs nothing until one is
touched: the `shardkit` command parses its arguments and prints `--help` without importing torch
(seconds), and a Ctrl-C while it starts is answered by the command, not by an import traceback.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import (BackendNotFoundError, BackendUnavailableError, PeerFailedError,
                     PluginLoadError, ShardkitError, UnsupportedOperationError)
from .lightning.registration import install as _lightning_hook
from .logs import configure_from_env as _configure_logging
from .job.parent_death import arm_if_launched as _arm_if_launched
from .checkpoint import (CheckpointError, CheckpointNotFoundError, CorruptCheckpointError,
                         IncompleteCheckpointError, StateDictMismatchError)
# Bound now: replicate shares its name with the submodule that defines it, and a later import of
# that submodule would otherwise put the module where the function belongs; spawn is bound with
# it. Neither imports torch.
from .replicate import replicate
from .job.spawn import SpawnError, spawn

if TYPE_CHECKING:  # what the names below resolve to, for type checkers and readers
    from . import checkpoint, wrap
    from .backend import API_VERSION, Backend, CollectiveSide, DeviceSide
    from .capabilities import AttentionCall, Capabilities
    from .global_mean import global_mean
    from .handles import CompletedWork, Group, NullEvent, NullStream, ReduceOp, TorchWork, Work
    from .launch_env import LaunchEnv, detect_launch_env
    from .planner import Plan, plan
    from .plugin import hookimpl, hookspec
    from .plugin.manager import register_plugin
    from .job.rendezvous import JobStoreError
    from .job.runtime import DistContext, current_context, init, shutdown
    from .seeding import seeded
    from .job.selection import backend_statuses, get_backend
    from .sharding import (FaultTolerance, MixedPrecision, Quantization, ShardingStrategy,
                           clip_grad_norm_, comm_stats, elementwise_optimizer,
                           fault_tolerant_optimizer, full_shape,
                           full_tensor, local_shard, register_forward_method, shard)
    from .sharding.setup.replicas import check_model_replicas as check_replicas
    from .sharding.step.verify import CollectiveOrderError

# public name -> (module, attribute in it); tests/test_cli_startup.py checks it against the block above
_LAZY: dict[str, tuple[str, str]] = {
    **{name: (".backend", name) for name in ("API_VERSION", "Backend", "CollectiveSide", "DeviceSide")},
    **{name: (".capabilities", name) for name in ("AttentionCall", "Capabilities")},
    **{name: (".handles", name) for name in ("CompletedWork", "Group", "NullEvent", "NullStream",
                                             "ReduceOp", "TorchWork", "Work")},
    "global_mean": (".global_mean", "global_mean"),
    **{name: (".launch_env", name) for name in ("LaunchEnv", "detect_launch_env")},
    **{name: (".planner", name) for name in ("Plan", "plan")},
    **{name: (".plugin", name) for name in ("hookimpl", "hookspec")},
    "register_plugin": (".plugin.manager", "register_plugin"),
    "JobStoreError": (".job.rendezvous", "JobStoreError"),
    **{name: (".job.runtime", name) for name in ("DistContext", "current_context", "init", "shutdown")},
    "seeded": (".seeding", "seeded"),
    **{name: (".job.selection", name) for name in ("backend_statuses", "get_backend")},
    **{name: (".sharding", name) for name in (
        "FaultTolerance", "fault_tolerant_optimizer", "MixedPrecision", "Quantization", "ShardingStrategy", "clip_grad_norm_", "comm_stats", "elementwise_optimizer",
        "full_shape", "full_tensor", "local_shard", "register_forward_method", "shard")},
    "check_replicas": (".sharding.setup.replicas", "check_model_replicas"),
    "CollectiveOrderError": (".sharding.step.verify", "CollectiveOrderError"),
    "checkpoint": (".checkpoint", ""),
    "wrap": (".wrap", ""),
}


def __getattr__(name: str) -> Any:
    """Import the module that defines a public name the first time the name is used."""
    if name not in _LAZY:
        raise AttributeError(f"module 'shardkit' has no attribute {name!r}")
    module_name, attribute = _LAZY[name]
    module = import_module(module_name, __name__)
    value = getattr(module, attribute) if attribute else module
    globals()[name] = value  # later uses are plain attribute lookups
    return value


def __dir__() -> list[str]:
    """The public names, resolved or not (for tab completion); not the imports this file uses."""
    return sorted(__all__)


# Every public name, bound above or resolved by __getattr__ (tests/test_cli_startup.py checks).
__all__ = [
    "API_VERSION", "AttentionCall", "Backend", "BackendNotFoundError", "BackendUnavailableError",
    "Capabilities", "CheckpointError", "CollectiveSide", "CheckpointNotFoundError", "CollectiveOrderError",
    "CompletedWork", "CorruptCheckpointError", "DeviceSide", "DistContext", "FaultTolerance", "Group",
    "IncompleteCheckpointError", "JobStoreError", "LaunchEnv", "MixedPrecision", "NullEvent",
    "NullStream", "PeerFailedError", "Plan", "PluginLoadError", "Quantization", "ReduceOp", "ShardingStrategy",
    "ShardkitError", "SpawnError", "StateDictMismatchError", "TorchWork",
    "UnsupportedOperationError", "Work", "__version__", "backend_statuses", "check_replicas",
    "checkpoint", "clip_grad_norm_", "comm_stats", "current_context", "detect_launch_env",
    "elementwise_optimizer", "fault_tolerant_optimizer", "full_shape", "full_tensor", "get_backend", "global_mean", "hookimpl", "hookspec", "init", "local_shard",
    "plan", "register_forward_method", "register_plugin", "replicate", "seeded", "shard",
    "shutdown", "spawn", "wrap",
]

_configure_logging()  # SHARDKIT_LOG=debug|info prints the "shardkit" logger to stderr
_lightning_hook()  # Trainer(strategy="shardkit") once Lightning is imported, which shardkit never does
_arm_if_launched()  # a rank of `shardkit launch` ends with it, even before init()
