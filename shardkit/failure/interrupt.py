"""Ctrl-C in a launched rank: noted, so that what follows from it is not reported as a failure.

A terminal sends SIGINT to the launcher and every rank at once. Each rank stops in a
KeyboardInterrupt and closes its sockets, so a peer still inside a collective fails there, and
its watchdog sees a dead peer: both are the Ctrl-C's consequences, not failures. Once a rank has
noted the Ctrl-C it prints nothing of them (SHARDKIT_DEBUG=1 brings the tracebacks back) and the
launcher says it once: "shardkit launch: interrupted; N ranks stopped" (cli/launch_agent.py).
"""

from __future__ import annotations

import signal
import threading
from typing import Any

INTERRUPTED_EXIT = 130  # what a shell reports for a process that a Ctrl-C ended

_interrupted = False


def interrupted() -> bool:
    """True once a Ctrl-C reached this process through the handler install() put in place."""
    return _interrupted


def _on_sigint(signum: int, frame: Any) -> None:
    global _interrupted
    _interrupted = True
    signal.default_int_handler(signum, frame)  # KeyboardInterrupt, as without this handler


def install() -> None:
    """Note a Ctrl-C before Python raises KeyboardInterrupt, where Python's own handler is in
    place (a handler the user installed is left alone)."""
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
        signal.signal(signal.SIGINT, _on_sigint)


def uninstall() -> None:
    """Put Python's own handler back if install()'s is still in place."""
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is _on_sigint):
        signal.signal(signal.SIGINT, signal.default_int_handler)


def reset() -> None:
    """Forget a noted Ctrl-C and put Python's handler back (process_state.reset)."""
    global _interrupted
    _interrupted = False
    uninstall()
