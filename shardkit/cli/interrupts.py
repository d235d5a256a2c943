"""Ctrl-C in the `shardkit` command: always answered as an interrupt (exit 130), never mid-import.

A KeyboardInterrupt raised while a C extension imports can do worse than stop the import: inside
torch's pybind11 start-up code it becomes a C++ exception that aborts the process (SIGABRT,
"terminate called after throwing an instance of 'pybind11::error_already_set'"), and inside an
exec() during an import (scipy runs `exec("from numpy import *")`) it leaves CPython to end the
process by SIGINT after `main()` returned. So a command's heavy imports run under
`deferred_ctrl_c()`: a Ctrl-C meanwhile is noted and raised once they are done, at a point where
Python code, not an extension, is running.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator


def note_ctrl_c() -> list[bool] | None:
    """While Python's own SIGINT handler is in place, record a Ctrl-C before raising as it does:
    the returned list is non-empty once one came (None: another handler is in place, left alone)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        return None
    pressed: list[bool] = []

    def on_sigint(signum: int, frame: Any) -> None:
        pressed.append(True)
        signal.default_int_handler(signum, frame)
    signal.signal(signal.SIGINT, on_sigint)
    return pressed


@contextlib.contextmanager
def deferred_ctrl_c() -> Iterator[None]:
    """Hold a Ctrl-C that arrives inside the block; raise it (through the handler in place
    before) as the block ends. Outside the main thread, or under a handler that is not a Python
    function (SIG_IGN), the block runs as it is."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield
        return
    held: list[tuple[int, Any]] = []
    signal.signal(signal.SIGINT, lambda signum, frame: held.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            previous(*held[0])  # main()'s handler: notes the press and raises KeyboardInterrupt
