"""Background saves: the step pays for copying shards to host memory; a thread writes them with no collectives.

Why no collectives in the writer thread: training keeps issuing collectives on the same process
group from the main thread, and a second thread issuing its own would interleave with them in a
different order on each rank (a hang, or one rank's gradients summed with another's checkpoint
bytes). So the writers coordinate through the checkpoint directory, which every rank already
shares for a synchronous save: each rank writes its DCP shard file and a marker with its files'
sha256; rank 0 waits for every marker, writes the DCP metadata, `extra` and the manifest, and
renames the directory into place. Until that rename the previous checkpoint at the path is the
one `load` reads; a kill at any moment leaves only an unfinished ``<path>.tmp-*`` directory,
which the next save removes. A failure on any rank is written beside that directory as
``<tmp>.failed`` so every rank's `wait()` raises with the cause.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from . import manifest as mf
from .dcp_io import FlatChunk, SaveItem
from .disk_full import NEARLY_FULL_BYTES, free_bytes, name_a_full_disk
from .errors import CheckpointError
from .host_io import write_metadata, write_rank

DONE_MARK = ".shardkit_rank{rank}.done"
FAILED_SUFFIX = ".failed"
_POLL_S = 0.02
# How long rank 0 waits for the other ranks' shard files: a rank that died mid-save never writes.
TIMEOUT_ENV = "SHARDKIT_CHECKPOINT_TIMEOUT"
DEFAULT_WRITE_TIMEOUT_S = 1800.0
_MAX_WRITE_TIMEOUT_S = 30 * 24 * 3600.0


def write_timeout_s() -> float:
    """SHARDKIT_CHECKPOINT_TIMEOUT in seconds (default 1800), refused with the valid range if bad."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_WRITE_TIMEOUT_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not 1.0 <= seconds <= _MAX_WRITE_TIMEOUT_S:
        raise CheckpointError(
            f"{TIMEOUT_ENV} must be a number of seconds from 1 to {_MAX_WRITE_TIMEOUT_S:.0f} (30 "
            f"days): how long rank 0 waits for the other ranks' shard files of a background "
            f"save; got {raw!r}. HINT: unset it for the default ({DEFAULT_WRITE_TIMEOUT_S:.0f} s), "
            f"or e.g. {TIMEOUT_ENV}=3600")
    return seconds


@dataclass(frozen=True)
class SaveJob:
    """Everything a background writer needs, taken in the step; it reads nothing from the model."""

    path: str
    tmp: str
    rank: int
    world_size: int
    save_id: str
    chunks: dict[str, SaveItem]  # host copies, owned by the job
    state_file: str
    state_blob: bytes  # rank 0's serialised `extra` and optimizer groups (empty elsewhere)
    info: dict
    timeout_s: float = DEFAULT_WRITE_TIMEOUT_S  # write_timeout_s() when save() was called


class BackgroundSave:
    """A checkpoint being written in the background: `wait()` for it, `done()` to ask."""

    def __init__(self, job: SaveJob) -> None:
        self.path = job.path
        self.host_bytes = sum(c.local.numel() * c.local.element_size() for c in job.chunks.values()
                              if isinstance(c, FlatChunk))
        self._job: SaveJob | None = job
        self._error: BaseException | None = None
        self._finished = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"shardkit-save-{job.save_id}",
                                        daemon=True)

    def _start(self) -> None:
        self._thread.start()

    def done(self) -> bool:
        """True once this rank knows the save's outcome (complete, or failed)."""
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> str:
        """Block until the checkpoint is complete on disk and return its path; raise if the save failed."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"the background save to {self.path} is still being written "
                               f"after {timeout} s")
        if self._thread is not threading.current_thread():
            # Its last lines are running: once this returns the caller may end the process, and
            # no writer may still run while the interpreter finalizes (see _run).
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self.path

    def abandon(self, reason: str) -> None:
        """Give the save up without waiting: mark it failed, so every rank's writer stops waiting
        for it and rank 0 removes its temporary directory; the previous checkpoint stays."""
        job = self._job
        if job is not None and not self._finished.is_set():
            _report_failure(job, f"rank {job.rank} left the job before the save completed "
                                 f"({reason})")

    def _run(self) -> None:
        job = self._job
        assert job is not None
        try:
            _write_part(job)
            if job.rank == 0:
                _finish(job)
            _await_outcome(job)
        except BaseException as exc:  # noqa: BLE001 - kept and raised by wait() in the caller's thread
            traceback.clear_frames(exc.__traceback__)  # its frames' locals hold the host copies
            self._error = exc if isinstance(exc, CheckpointError) else CheckpointError(
                f"the background save to {job.path} failed: {type(exc).__name__}: {exc}")
        finally:
            # The host copies are freed here, before anyone is told the save is over. Left to
            # this frame's teardown, they were freed after the main thread, told, had gone on to
            # exit: a tensor freed while the interpreter finalizes takes the GIL from torch's
            # noexcept destructor, Python ends the thread there (pthread_exit), and the unwind
            # through that destructor is std::terminate: "terminate called without an active
            # exception", SIGABRT (issue 55; the core dump's writer thread was in
            # ~TensorImpl -> decref_pyobject -> take_gil -> PyThread_exit_thread).
            self._job = None
            del job
            self._finished.set()
            _forget(self)


_pending: list[BackgroundSave] = []
_lock = threading.Lock()


def start(job: SaveJob) -> BackgroundSave:
    """Start writing `job` in a thread; the returned handle is also awaited by the next save and at exit."""
    handle = BackgroundSave(job)
    with _lock:
        _pending.append(handle)
    handle._start()
    return handle


def _forget(handle: BackgroundSave) -> None:
    with _lock:
        if handle in _pending:
            _pending.remove(handle)


def forget_pending() -> None:
    """Forget the pending saves without waiting (process_state.reset; their threads end on their own)."""
    with _lock:
        _pending.clear()


def wait_pending() -> None:
    """Wait for every background save this process started; raise the first failure."""
    with _lock:
        handles = list(_pending)
    for handle in handles:
        handle.wait()


def abandon_pending(reason: str) -> None:
    """Give up every background save this process started, without waiting for peers (a rank
    that ends after a failure: they may be dead, and waiting for them took the write timeout).

    Returns once every save is marked failed, whichever thread marks it: a survivor's watchdog
    and its main thread both abandon on their way to os._exit, and the one that found the list
    empty used to exit while the other was still removing the temporary directory (left
    half-removed and unmarked; issue 55, from the long lane)."""
    with _lock:  # held while marking: a second caller waits for the first's markers
        handles = list(_pending)
        _pending.clear()
        for handle in handles:
            handle.abandon(reason)


@atexit.register
def _finish_at_exit() -> None:
    # A script that ends right after save(background=True) still gets its checkpoint; one that
    # ends with an uncaught exception (CPython sets sys.last_value before atexit) must not wait
    # for peers that may be gone.
    if getattr(sys, "last_value", None) is not None:
        abandon_pending(f"it ended with {type(sys.last_value).__name__}")
        return
    for handle in list(_pending):
        try:
            handle.wait()
        except (CheckpointError, TimeoutError) as exc:
            print(f"shardkit: {exc}", flush=True)


def _write_part(job: SaveJob) -> None:
    """Write this rank's shard file, then its marker listing that file's sha256 (the marker comes last)."""
    try:
        write_rank(job.tmp, job.chunks, job.rank)
        digests = {rel: mf.sha256_file(os.path.join(job.tmp, rel))
                   for rel in mf.data_files(job.tmp) if rel.startswith(f"__{job.rank}_")}
        mf.write_json_atomic(os.path.join(job.tmp, DONE_MARK.format(rank=job.rank)), digests)
    except Exception as exc:
        _report_failure(job, f"rank {job.rank} could not write its shards into {job.tmp}: "
                             + name_a_full_disk(job.tmp, f"{type(exc).__name__}: {exc}"))
        raise CheckpointError(_failure_text(job)) from exc


def _finish(job: SaveJob) -> None:
    """Rank 0: once every rank's marker is there, write metadata, state and manifest, then rename."""
    deadline = time.monotonic() + job.timeout_s
    markers = [os.path.join(job.tmp, DONE_MARK.format(rank=r)) for r in range(job.world_size)]
    while not all(os.path.exists(m) for m in markers):
        if os.path.exists(job.tmp + FAILED_SUFFIX):
            shutil.rmtree(job.tmp, ignore_errors=True)
            raise CheckpointError(_failure_text(job))
        if time.monotonic() > deadline:
            missing = [r for r, m in enumerate(markers) if not os.path.exists(m)]
            _report_failure(job, f"rank(s) {missing} did not finish writing their shards within "
                                 f"{job.timeout_s:.0f} s ({TIMEOUT_ENV})")
            raise CheckpointError(_failure_text(job))
        time.sleep(_POLL_S)
    try:
        digests: dict[str, str] = {}
        for marker in markers:
            with open(marker) as f:
                digests.update(json.load(f))
            os.remove(marker)
        write_metadata(job.tmp, job.world_size)
        mf.write_file_synced(os.path.join(job.tmp, job.state_file), job.state_blob)
        for rel in mf.data_files(job.tmp):
            if rel not in digests:
                digests[rel] = mf.sha256_file(os.path.join(job.tmp, rel))
        mf.write_manifest(job.tmp, job.info, digests)
        mf.replace_dir(job.tmp, job.path)
    except Exception as exc:
        _report_failure(job, f"rank 0 could not complete {job.path}: {type(exc).__name__}: {exc}")
        raise CheckpointError(_failure_text(job)) from exc


def _await_outcome(job: SaveJob) -> None:
    """Return once the manifest carrying this save's id is in place; raise on a reported failure."""
    deadline = time.monotonic() + job.timeout_s + 60
    while not _is_complete(job):
        if os.path.exists(job.tmp + FAILED_SUFFIX):
            shutil.rmtree(job.tmp, ignore_errors=True)  # this rank's part, written after a removal
            raise CheckpointError(_failure_text(job))
        if time.monotonic() > deadline:
            raise CheckpointError(f"the background save to {job.path} did not complete within "
                                  f"{job.timeout_s:.0f} s; rank 0 may have died. The previous "
                                  "checkpoint there, if any, is untouched.")
        time.sleep(_POLL_S)


def _is_complete(job: SaveJob) -> bool:
    # The save that follows this one waits for it first, so the id cannot be overwritten unseen;
    # `.old` holds it for the instant between replace_dir's two renames.
    for directory in (job.path, job.path + mf.OLD_SUFFIX):
        try:
            with open(os.path.join(directory, mf.MANIFEST_FILE)) as f:
                if json.load(f).get("save_id") == job.save_id:
                    return True
        except (OSError, ValueError):
            continue
    return False


def _report_failure(job: SaveJob, text: str) -> None:
    # Never a checkpoint: give the space back first (on a full disk the report itself needs it).
    # Any rank removes it: a writer still running elsewhere may recreate the directory (DCP's
    # writer makes it), so each rank's writer removes it again as it ends (_await_outcome).
    shutil.rmtree(job.tmp, ignore_errors=True)
    try:
        with open(job.tmp + FAILED_SUFFIX, "x") as f:
            f.write(text)
        return
    except FileExistsError:
        pass  # the first failure is the one to report ...
    except OSError:
        return
    try:  # ... unless the disk was too full to hold its words: the removal above made room
        if os.path.getsize(job.tmp + FAILED_SUFFIX) == 0:
            with open(job.tmp + FAILED_SUFFIX, "w") as f:
                f.write(text)
    except OSError:
        pass


def _failure_text(job: SaveJob) -> str:
    try:
        with open(job.tmp + FAILED_SUFFIX) as f:
            cause = f.read().strip()
    except OSError:
        cause = ""
    if not cause:  # the report could not be written: most likely the disk is full
        free = free_bytes(job.tmp)
        cause = (f"no space left on device ({free} bytes free on the file system; the failing "
                 "rank's own report could not be written)" if free is not None and free < NEARLY_FULL_BYTES
                 else "a rank failed and its report could not be written")
    return (f"the background save to {job.path} failed: {cause}. Any previous checkpoint at "
            f"{job.path} is untouched. HINT: free space on that file system or save somewhere "
            "writable.")

