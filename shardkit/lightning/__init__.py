"""shardkit as a Lightning strategy: `Trainer(strategy="shardkit")`, `Fabric(strategy="shardkit")` (the lightning extra).

Layout: strategy (the Trainer's ``ShardkitStrategy``), fabric (``ShardkitFabricStrategy``), common
(what both share: options, joining the job, sharding a module), precision (Lightning's precision
flags as shardkit settings, clipping across shards), registration ("shardkit" in Lightning's
registries when Lightning is imported, without importing it)."""

from __future__ import annotations

from typing import Any

from ..errors import ShardkitError
from ..install_hint import pip_install_extra


def __getattr__(name: str) -> Any:
    """ShardkitStrategy (Trainer) and ShardkitFabricStrategy, imported with Lightning on first use."""
    if name not in __all__:
        raise AttributeError(f"module 'shardkit.lightning' has no attribute {name!r}")
    try:
        from .fabric import ShardkitFabricStrategy
        from .strategy import ShardkitStrategy
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == "lightning":
            raise ShardkitError(f"ShardkitStrategy needs Lightning, which is not installed "
                                f"({exc}). HINT: {pip_install_extra('lightning')}") from exc
        raise
    return ShardkitStrategy if name == "ShardkitStrategy" else ShardkitFabricStrategy


__all__ = ["ShardkitFabricStrategy", "ShardkitStrategy"]
