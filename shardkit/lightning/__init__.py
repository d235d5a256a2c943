"""shardkit as a PyTorch Lightning strategy: `Trainer(strategy="shardkit")` (pip install 'shardkit[lightning]')."""

from __future__ import annotations

from typing import Any

from ..errors import ShardkitError
from ..install_hint import pip_install_extra


def __getattr__(name: str) -> Any:
    """ShardkitStrategy, imported with Lightning on first use."""
    if name != "ShardkitStrategy":
        raise AttributeError(f"module 'shardkit.lightning' has no attribute {name!r}")
    try:
        from .strategy import ShardkitStrategy
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == "lightning":
            raise ShardkitError(f"ShardkitStrategy needs Lightning, which is not installed "
                                f"({exc}). HINT: {pip_install_extra('lightning')}") from exc
        raise
    return ShardkitStrategy


__all__ = ["ShardkitStrategy"]
