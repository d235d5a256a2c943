"""Which peers share this rank's machine, and whether a local process is still alive.

The watchdog notices a SIGKILLed peer within a tick by checking its pid, which only means
something for a process in the same pid namespace of the same running kernel. A hostname alone
does not say that: containers on different machines often share one ("localhost", a pod
template), and two containers on one machine have separate pid namespaces. So a node is named by
hostname, kernel boot id and pid-namespace inode together; where /proc cannot tell those
(macOS), no peer counts as local and deaths are noticed by missing heartbeats instead.
"""

from __future__ import annotations

import os
import socket

PROC = "/proc"  # a module constant so tests can point it at a directory without /proc's files


def node_identity() -> str | None:
    """A name equal for exactly the processes whose pids this one can check, or None if unknown."""
    try:
        with open(os.path.join(PROC, "sys", "kernel", "random", "boot_id")) as f:
            boot = f.read().strip()
        pid_ns = os.stat(os.path.join(PROC, "self", "ns", "pid")).st_ino
    except OSError:
        return None
    return f"{socket.gethostname()}/{boot}/{pid_ns}"


def pid_alive(pid: int) -> bool:
    """False only when process `pid` of this pid namespace is known to be gone (or a zombie)."""
    try:
        with open(os.path.join(PROC, str(pid), "stat")) as f:
            # A zombie has exited; only its parent has not reaped it yet.
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        if os.path.isdir(os.path.join(PROC, "self")):
            return False  # /proc works and has no such process
    except OSError:
        pass
    try:  # no usable /proc: ask the kernel directly
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
