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
without shardkit. A launched rank asks at `import shardkit` (arm_if_launched), so a launcher
killed while its ranks still import torch or load data takes them along too.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

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


def arm_if_launched() -> None:
    """In a rank `shardkit launch` started: end with the launcher, even one that is already gone.

    Runs at `import shardkit`, not only at init(): a rank spends seconds importing torch and
    loading data before init(), and a launcher killed then left it running until its rendezvous
    timed out (61-92 s, issue 39). A launcher that died before this rank could ask the kernel
    (its parent is no longer the launcher's pid) ends the rank now, with one line saying why.
    """
    launcher = os.environ.get(PARENT_PID_ENV, "")
    if not launcher.isdigit():
        return
    if launcher == str(os.getppid()):
        die_with_parent()
        return
    from ..failure.node import pid_alive

    if not pid_alive(int(launcher)):
        sys.stderr.write(f"shardkit: the `shardkit launch` process (pid {launcher}) that started "
                         "this rank has ended; this rank ends too\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGTERM)


def end_with_process(pid: int) -> None:
    """End this process (SIGTERM to itself, so it reports where it was) once process `pid` is gone."""
    from ..failure.node import pid_alive

    def watch() -> None:
        while pid_alive(pid):
            threading.Event().wait(_WATCH_INTERVAL_S)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="shardkit-parent-watch", daemon=True).start()
