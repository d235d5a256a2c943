"""One reset for all of shardkit's process-global state, for tests and for long-lived processes."""

from __future__ import annotations

from .. import process_state


def reset_state() -> None:
    """Put every process-wide thing shardkit keeps back as a new process has it (process_state.reset).

    It shuts down the current job, removes the hooks init() and shard() installed, lets plugins
    drop their state (the ``shardkit_reset_state`` hook: the xla backend forgets the barriers its
    device threads shared), and forgets plugins, Backend objects and every registry: the next
    shardkit call rediscovers plugins and builds fresh Backend objects. shardkit.process_state
    lists each thing with what it is and why it is process-wide.
    """
    process_state.reset()
