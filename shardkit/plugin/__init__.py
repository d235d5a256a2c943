"""Plugin machinery: pluggy hookspecs, the backend registry, and entry-point discovery.

Layout: spec (the hooks a plugin may implement), registry (the object handed to
``shardkit_register_backends``), manager (entry-point discovery, failures kept for selection)."""

from .spec import hookimpl, hookspec
from .registry import BackendRegistry

ENTRY_POINT_GROUP = "shardkit"

__all__ = ["ENTRY_POINT_GROUP", "BackendRegistry", "hookimpl", "hookspec"]
