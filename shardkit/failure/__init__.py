"""Failure handling for a running job: the timeout, the watchdog, and what a failing rank reports."""

from __future__ import annotations

import atexit
import datetime
import os
import signal
import sys
import threading
from typing import Any

from ..errors import PeerFailedError, ShardkitError
from . import where
from .watchdog import PEER_FAILED_EXIT, Failure, Watchdog, as_seconds, default_store_client, emit

__all__ = ["DEFAULT_ACCELERATOR_TIMEOUT", "DEFAULT_TIMEOUT", "PEER_FAILED_EXIT", "Failure", "TIMEOUT_ENV", "Watchdog",
           "on_exception", "resolve_timeout", "start", "stop", "where"]

TIMEOUT_ENV = "SHARDKIT_TIMEOUT"
# Long enough for a slow step or a checkpoint write on one rank, short enough that a dead peer
# never parks a job for the half hour torch's own default allows.
DEFAULT_TIMEOUT = datetime.timedelta(seconds=30)
# Accelerator jobs may legitimately keep peers waiting for minutes (a first compile or autotune
# on one rank): the 10 minutes torch itself uses for accelerator process groups.
DEFAULT_ACCELERATOR_TIMEOUT = datetime.timedelta(minutes=10)

# How long a SIGTERMed rank waits for a report already being written (torchrun waits 30 s
# before it escalates to SIGKILL).
_SIGTERM_GRACE_S = 2.0
_watchdog: Watchdog | None = None
_previous_excepthook = None


def resolve_timeout(timeout: datetime.timedelta | float | None,
                    default: datetime.timedelta = DEFAULT_TIMEOUT) -> datetime.timedelta:
    """The job's timeout: the argument, else SHARDKIT_TIMEOUT (seconds), else `default`.

    init() passes the backend's `capabilities.default_timeout` (30 s on cpu, 10 min elsewhere).
    """
    source = "timeout"
    given: datetime.timedelta | float | str | None = timeout
    if given is None and os.environ.get(TIMEOUT_ENV):
        given, source = os.environ[TIMEOUT_ENV], TIMEOUT_ENV
    if given is None:
        return default
    try:
        seconds = as_seconds(given)
    except (TypeError, ValueError):
        seconds = float("nan")
    if not seconds > 0:
        raise ShardkitError(f"{source} must be a positive number of seconds or a timedelta, got "
                            f"{given!r}; e.g. shardkit.init(timeout=60) or {TIMEOUT_ENV}=60")
    return datetime.timedelta(seconds=seconds)


def start(rank: int, world_size: int, timeout: datetime.timedelta, shares_process: bool) -> None:
    """Start this rank's watchdog (process-group jobs of two or more ranks only)."""
    global _watchdog, _previous_excepthook
    where.reset()
    if world_size < 2 or shares_process or _watchdog is not None:
        return
    store = default_store_client()
    if store is None:
        return
    _watchdog = Watchdog(store, rank, world_size, as_seconds(timeout))
    # Launchers (torchrun) SIGTERM the other ranks as soon as one fails: say where this one was.
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
        signal.signal(signal.SIGTERM, _on_sigterm)
    if _previous_excepthook is None:
        _previous_excepthook = sys.excepthook
        sys.excepthook = _excepthook
        atexit.register(stop)


def stop() -> None:
    """Stop the watchdog: this rank is done, and peers must not mistake its exit for a death."""
    global _watchdog
    wd, _watchdog = _watchdog, None
    if wd is not None:
        wd.finish()
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) is _on_sigterm):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _on_sigterm(signum: int, frame: Any) -> None:
    wd = _watchdog
    # Another path (the watchdog thread, or this thread's exception report that the signal just
    # interrupted) may have claimed the report without printing it yet: give it a moment, then
    # speak for this rank ourselves.
    if wd is not None and (wd.claim_report() or not wd.report_written.wait(_SIGTERM_GRACE_S)):
        try:
            failures = wd.check()
        except Exception:  # noqa: BLE001 - the store may be gone too
            failures = []
        known = "; ".join(str(f) for f in failures) or "no failed rank known here"
        emit(f"shardkit: rank {wd.rank} was terminated (SIGTERM; a launcher does this to every "
             f"rank once one failed: {known}); it was in {where.describe()}")
        wd.report_written.set()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)  # end by the signal, as without this handler


def active() -> Watchdog | None:
    """The running watchdog of this process, if any."""
    return _watchdog


def _looks_like_a_collective_failure(exc: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(s in text for s in (
        "Connection closed", "Connection reset", "Connection refused", "Broken pipe",
        "Timed out", "timed out", "Socket Timeout", "gloo", "Gloo",
        # gloo's words when a broadcast or all-reduce waits past the timeout on its peer
        "Application timeout caused pair closure"))


def on_exception(exc: BaseException) -> BaseException:
    """Report an exception that ends this rank; return the exception the rank should end with.

    A collective that failed because a peer died becomes a PeerFailedError naming that peer and
    where this rank was. Any other exception is this rank's own failure: it is posted so every
    peer names this rank, and returned unchanged.
    """
    wd = _watchdog
    if wd is None or isinstance(exc, (PeerFailedError, KeyboardInterrupt)):
        return exc
    if _looks_like_a_collective_failure(exc):
        failures = wd.diagnose(wait=min(wd.timeout, 3.0))
        if failures:
            if not wd.claim_report():
                return exc
            message = wd.survivor_message(failures)
            emit(message)
            wd.report_written.set()
            wd.acknowledge()
            wd.linger(failures)
            return PeerFailedError(message)
        message = (f"shardkit: a collective failed on rank {wd.rank} in {where.describe()}, and no "
                   f"other rank failed: {exc}. HINT: the ranks probably issued different "
                   "collectives (run with SHARDKIT_DEBUG=1 to name the first difference), or one "
                   f"rank was busy for longer than timeout={wd.timeout:g} s (raise it with "
                   "shardkit.init(timeout=...) or SHARDKIT_TIMEOUT)")
        emit(message)
        return ShardkitError(message)
    if wd.claim_report():
        wd.post(f"raised {type(exc).__name__}: {exc} (in {where.describe()})")
        wd.report_written.set()  # its own traceback is the report
    return exc


def _excepthook(tp: type, value: BaseException, tb: Any) -> None:
    hook = _previous_excepthook or sys.__excepthook__
    hook(tp, value, tb)
    on_exception(value)
