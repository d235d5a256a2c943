"""The graph cut after every optimizer step, for backends whose capabilities ask for one.

A lazy device (XLA) needs its graph cut after `opt.step()`: without it the optimizer's updates
stay pending and the traced graph grows with every step. `shardkit.init()` registers one global
optimizer step post-hook when the backend sets `capabilities.needs_step_boundary`, so a loop
written for CPU/CUDA runs unchanged and no backend has to install hooks itself. The hook only acts
in threads whose shardkit context uses such a backend, and calls its `step_boundary()`.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

_handle: Any = None  # torch's RemovableHandle while the hook is installed
_context_of_thread: Callable[[], Any] | None = None  # runtime.current_context, handed in
_lock = threading.Lock()


def _after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    ctx = _context_of_thread() if _context_of_thread is not None else None
    if ctx is not None and ctx.backend.capabilities.needs_step_boundary:
        ctx.backend.devices.step_boundary()


def install_step_hook(context_of_thread: Callable[[], Any]) -> None:
    """Register the post-step hook with torch.optim (once per process); `context_of_thread`
    returns this thread's shardkit context (runtime hands in its own lookup, so this module
    needs nothing above it)."""
    global _handle, _context_of_thread
    with _lock:
        _context_of_thread = context_of_thread
        if _handle is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            _handle = register_optimizer_step_post_hook(_after_step)


def remove_step_hook() -> None:
    """Unregister the post-step hook if installed (shutdown(), process_state.reset)."""
    global _handle, _context_of_thread
    with _lock:
        handle, _handle, _context_of_thread = _handle, None, None
    if handle is not None:
        handle.remove()
