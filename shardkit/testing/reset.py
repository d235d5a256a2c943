"""One reset for all of shardkit's process-global state, for tests and for long-lived processes."""

from __future__ import annotations

from ..plugin.manager import reset_plugins
from ..runtime import current_context, shutdown
from ..selection import forget_backend_instances


def reset_state() -> None:
    """Shut down the current context, let plugins drop their state, forget plugins and backend objects.

    After it, the next shardkit call rediscovers plugins and builds fresh Backend objects, as in a
    new process. Plugins drop their own state through the ``shardkit_reset_state`` hook (the xla
    backend forgets the barriers its device threads shared).
    """
    if current_context() is not None:
        shutdown()
    reset_plugins()
    forget_backend_instances()
