"""Plugin machinery: pluggy hookspecs, the backend registry, and entry-point discovery."""

from .spec import hookimpl, hookspec
from .registry import BackendRegistry

ENTRY_POINT_GROUP = "shardkit"

__all__ = ["ENTRY_POINT_GROUP", "BackendRegistry", "hookimpl", "hookspec"]
