"""One report for an error that every rank raises alike (a typo in shard()'s arguments, a missing
checkpoint): the first rank of a node to raise it prints its traceback, the others nothing.

Ranks of one launch on one node share a marker directory in the temporary folder, named after
their launcher (its pid and start time, and the restart count, so a restarted attempt reports
again). A rank claims an error by creating a file named after its type and message; creating it
is atomic (O_EXCL), so exactly one rank wins, without the job's store (the error may come before
there is one, as a wrong backend name in init() does). SHARDKIT_DEBUG=1 prints every rank's.
"""

from __future__ import annotations

import hashlib
import os
import tempfile

from ..launch_env import job_identity


def folder_prefix(launcher_pid: int) -> str:
    """The start of the marker folders of the ranks a launcher with this pid started (it removes them)."""
    return os.path.join(tempfile.gettempdir(), f"shardkit-errors-{launcher_pid}-")


def _launch_key() -> str:
    """What the ranks of this launch on this node share, and no other launch: the job's id
    (shardkit.spawn's per call, torchrun's run id, a scheduler's job), the parent, its start."""
    parent = os.getppid()
    try:
        with open(f"/proc/{parent}/stat") as f:
            started = f.read().rsplit(")", 1)[1].split()[19]  # field 22: start time in ticks
    except (OSError, IndexError):
        started = "?"
    return "-".join((job_identity() or "", str(parent), started,
                     os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))


def first_to_report(exc: BaseException) -> bool:
    """True unless another rank of this launch on this node already reported the same error
    (the caller asks only in a launched rank: failure.launched_rank)."""
    folder = folder_prefix(os.getppid()) + hashlib.sha1(_launch_key().encode()).hexdigest()[:16]
    said = f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}"
    name = hashlib.sha1(said.encode(errors="replace")).hexdigest()
    try:
        os.makedirs(folder, exist_ok=True)
        os.close(os.open(os.path.join(folder, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    except OSError:
        return True  # no shared folder to agree in: every rank speaks, as before
    return True
