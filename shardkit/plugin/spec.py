"""The hooks a shardkit plugin may implement. A backend plugin needs only the first."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import pluggy

if TYPE_CHECKING:
    from .registry import BackendRegistry

PROJECT_NAME = "shardkit"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def shardkit_register_backends(registry: "BackendRegistry") -> None:
    """Add Backend subclasses with ``registry.add(cls)``.

    Called once, at discovery. Must not import vendor packages or touch a device: do that lazily
    inside the Backend's methods so that ``import shardkit`` stays cheap and never fails.
    """


@hookspec(firstresult=True)
def shardkit_select_backend(available: Sequence[str], registered: Sequence[str]) -> str | None:
    """Site policy: return the name of the backend to use when none was asked for, or None.

    ``available`` lists the names whose backends can run here, best first by priority;
    ``registered`` lists every registered name. Only consulted when neither ``backend=`` nor
    ``SHARDKIT_BACKEND`` chose one.
    """


@hookspec
def shardkit_reset_state() -> None:
    """Drop the process-global state this plugin keeps (caches, barriers, handles).

    Called by ``shardkit.testing.reset_state()``, after the current context is shut down and
    before the plugins themselves are forgotten, so the next run in this process starts clean.
    """
