"""Ranks end when the process that launched them ends, however it ended.

A SIGTERM to the process that called `shardkit.spawn` (`kill PID`, a container stop, a scheduler
taking the node back) ends that process at once, and nothing tells its ranks: they train on as
orphans, holding memory, devices and the job's port. SIGKILL cannot even be caught. Linux can
signal a child when its parent dies (prctl PR_SET_PDEATHSIG), which covers every way the parent
can end; the rank then gets SIGTERM, reports where it was and exits. A spawned rank's parent is
not always the caller, though: under the "forkserver" start method it is the fork server, which
outlives the caller for as long as any rank holds its lifeline pipe (every rank does). So spawned
ranks watch the caller's pid instead, from a daemon thread. Only launch paths shardkit owns ask
for either (spawn's ranks, and ranks whose parent is the `shardkit launch` process): a rank
started by a shell or a user's own launcher keeps running when that parent exits, as it would
without shardkit.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

from .failure.node import pid_alive

PARENT_PID_ENV = "SHARDKIT_PARENT_PID"  # set by `shardkit launch` to its own pid (kept by exec)
_PR_SET_PDEATHSIG = 1
_WATCH_INTERVAL_S = 0.5


def die_with_parent() -> bool:
    """Have this process sent SIGTERM when its parent ends; False where the OS cannot (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() == 1:
        # The parent died before the request was made, so no signal will come: act on it now.
        os.kill(os.getpid(), signal.SIGTERM)
    return True


def launched_by_shardkit() -> bool:
    """True when this process's parent is the `shardkit launch` process (or the launcher it became)."""
    return os.environ.get(PARENT_PID_ENV) == str(os.getppid())


def end_with_process(pid: int) -> None:
    """End this process (SIGTERM to itself, so it reports where it was) once process `pid` is gone."""
    def watch() -> None:
        while pid_alive(pid):
            threading.Event().wait(_WATCH_INTERVAL_S)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="shardkit-parent-watch", daemon=True).start()
