"""Failure handling for a running job: the timeout, the watchdog, and what a failing rank reports.

watchdog (heartbeats and the failure board), where (the unit and phase a rank is in),
launcher_record (the error file torchrun reads), same_error (an error every rank raises alike is
printed once per node), interrupt (a Ctrl-C noted, so what follows from it is not reported),
node (which peers share this host).
"""

from __future__ import annotations

import atexit
import datetime
import os
import signal
import sys
import threading
from typing import Any

from .. import env_flags
from ..env_flags import env_flag
from ..errors import PeerFailedError, ShardkitError
from . import interrupt, launcher_record, same_error, where
from .watchdog import (PEER_FAILED_EXIT, Failure, Watchdog, abandon_background_saves, as_seconds,
                       default_store_client, emit)

__all__ = ["DEFAULT_ACCELERATOR_TIMEOUT", "DEFAULT_TIMEOUT", "PEER_FAILED_EXIT", "Failure", "TIMEOUT_ENV",
           "WATCHDOG_ENV", "Watchdog", "interactive", "on_exception", "resolve_timeout", "start",
           "stop", "watchdog_requested", "where"]

TIMEOUT_ENV = "SHARDKIT_TIMEOUT"
DEBUG_ENV = env_flags.DEBUG
WATCHDOG_ENV = env_flags.WATCHDOG
# Long enough for a slow step or a checkpoint write on one rank, short enough that a dead peer
# never parks a job for the half hour torch's own default allows.
DEFAULT_TIMEOUT = datetime.timedelta(seconds=30)
MIN_TIMEOUT_S = 1.0
MAX_TIMEOUT_S = 30 * 24 * 3600.0
# Accelerator jobs may legitimately keep peers waiting for minutes (a first compile or autotune
# on one rank): the 10 minutes torch itself uses for accelerator process groups.
DEFAULT_ACCELERATOR_TIMEOUT = datetime.timedelta(minutes=10)

# How long a SIGTERMed rank waits for a report already being written (torchrun waits 30 s
# before it escalates to SIGKILL).
_SIGTERM_GRACE_S = 2.0
_watchdog: Watchdog | None = None
_previous_excepthook = None
_original_excepthook = None  # sys.excepthook before shardkit's: stop() puts it back
_in_excepthook = threading.local()  # set while _excepthook runs: a hook it calls may call it back
_parent_at_start = os.getppid()  # a SIGTERM after the parent changed came from its death


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
    except (TypeError, ValueError, OverflowError):
        seconds = float("nan")
    if not MIN_TIMEOUT_S <= seconds <= MAX_TIMEOUT_S:
        raise ShardkitError(
            f"{source} must be a number of seconds (or a timedelta) from {MIN_TIMEOUT_S:g} to "
            f"{MAX_TIMEOUT_S:.0f} (30 days), got {given!r}; e.g. shardkit.init(timeout=60) or "
            f"{TIMEOUT_ENV}=60. Below a second a store round trip can take longer than the "
            "timeout; above 30 days torch's millisecond timers overflow, and 30 days is no "
            "limit in practice")
    return datetime.timedelta(seconds=seconds)


def watchdog_requested(watchdog: bool | None) -> bool:
    """init(watchdog=...) if given, else SHARDKIT_WATCHDOG (on unless 0/false/no/off)."""
    if watchdog is not None:
        if not isinstance(watchdog, bool):
            raise ShardkitError(f"watchdog must be True, False or None, got {watchdog!r}")
        return watchdog
    return env_flag(WATCHDOG_ENV, default=True)


def interactive() -> bool:
    """True in a REPL or a notebook kernel: a process that must never be ended for the user."""
    return hasattr(sys, "ps1") or bool(sys.flags.interactive) or "ipykernel" in sys.modules


def start(rank: int, world_size: int, timeout: datetime.timedelta, shares_process: bool,
          enabled: bool = True) -> None:
    """Start this rank's watchdog (process-group jobs of two or more ranks only).

    In a launched rank it also reports through sys.excepthook and on SIGTERM, and ends the
    process when a peer failed (its training thread may be stuck in a collective). In an
    interactive process it only reports: the stuck call then fails by the timeout and raises.
    """
    global _watchdog, _previous_excepthook, _parent_at_start
    where.reset()
    _parent_at_start = os.getppid()
    if not enabled or world_size < 2 or shares_process or _watchdog is not None:
        return
    store = default_store_client()
    if store is None:
        return
    launched = not interactive()
    _watchdog = Watchdog(store, rank, world_size, as_seconds(timeout), may_exit=launched)
    atexit.register(stop)
    if not launched:
        return
    # Launchers (torchrun) SIGTERM the other ranks as soon as one fails: say where this one was.
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
        signal.signal(signal.SIGTERM, _on_sigterm)
    _install_report_hooks()


def launched_rank() -> bool:
    """True in a process a launcher started as one rank of several, or as the one rank of a
    torchrun job (whose agent reads the error file this rank writes), never in a REPL or notebook."""
    try:
        several = int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        several = False
    return (several or bool(os.environ.get(launcher_record.ERROR_FILE_ENV))) and not interactive()


def install_report_hooks() -> None:
    """In a launched rank: the excepthook (one report per event) and the Ctrl-C note.

    init() installs them before anything can fail (a wrong backend name fails before there is a
    job, and every rank would print it); start() again once the watchdog runs.
    """
    if launched_rank():
        _install_report_hooks()


def _install_report_hooks() -> None:
    global _previous_excepthook, _original_excepthook
    interrupt.install()
    if sys.excepthook is _excepthook:
        return
    if _previous_excepthook is None:
        _original_excepthook = _previous_excepthook = sys.excepthook
    else:
        # init() installed ours before the process group, and torch's init_process_group then
        # wrapped it in its rank-prefixing hook, which prints what the hook it wraps writes to
        # a buffer: a report printed in ours, before os._exit, would stay in that buffer. Ours
        # goes outside again; torch's calls ours back, which then prints as the original would.
        _previous_excepthook = sys.excepthook
    sys.excepthook = _excepthook


def stop(leaving_with: BaseException | None = None) -> None:
    """Stop the watchdog and put back what start() installed; peers must not take this rank's
    exit for a death. `leaving_with`: the exception about to leave the rank, whose exit the hook
    still has to shape when it is a reported peer failure."""
    global _watchdog, _previous_excepthook, _original_excepthook
    wd, _watchdog = _watchdog, None
    if wd is not None:
        wd.finish()
        atexit.unregister(stop)  # start() registered it with this watchdog: one per job, not per init()
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is _on_sigterm):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if isinstance(leaving_with, PeerFailedError) and leaving_with.reported:
        return  # the hook ends the process with PEER_FAILED_EXIT if nothing catches it
    interrupt.uninstall()
    if _previous_excepthook is not None and sys.excepthook is _excepthook:
        # Torch's hook, where it wrapped ours, would call ours back: the original goes back.
        sys.excepthook = _original_excepthook or _previous_excepthook
    _previous_excepthook = _original_excepthook = None


def reset() -> None:
    """Stop the watchdog, put back what start() installed, forget the phase (process_state.reset)."""
    global _parent_at_start
    stop()
    where.reset()
    _parent_at_start = os.getppid()


def _on_sigterm(signum: int, frame: Any) -> None:
    wd = _watchdog
    # Another path (the watchdog thread, or this thread's exception report that the signal just
    # interrupted) may have claimed the report without printing it yet: give it a moment, then
    # speak for this rank ourselves.
    if wd is not None and (wd.claim_report() or not wd.report_written.wait(_SIGTERM_GRACE_S)):
        orphaned = os.getppid() != _parent_at_start
        # First: a peer may look for this process before it is gone.
        wd.mark_terminated(orphaned)
        try:
            # Peers the same SIGTERM ended are not why this rank was stopped.
            failures = [f for f in wd.check() if not f.stopped]
        except Exception:  # noqa: BLE001 - the store may be gone too
            failures = []
        # A peer that stopped after reporting a failure is why the launcher stops this rank:
        # what it reported says more than this rank sees (a remote rank still within timeout).
        known = wd.culprits(failures) or wd.reported_by_a_peer()
        if known:
            why = f"a launcher does this to every rank once one failed: {known}"
        elif orphaned:
            why = "the process that launched it ended"
        else:
            # No rank failed: the job itself was ended (a scheduler's cancel, time limit or
            # requeue, a kill of the launcher), and the launcher passed the signal on.
            why = ("from its launcher or a scheduler; no rank is known to have failed, so the job "
                   "was stopped from outside: scancel, a time limit, a requeue, or a kill")
        emit(f"shardkit: rank {wd.rank} was terminated (SIGTERM; {why}); it was in "
             f"{where.describe()}")
        wd.report_written.set()
    abandon_background_saves("it was terminated")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)  # end by the signal, as without this handler


def active() -> Watchdog | None:
    """The running watchdog of this process, if any."""
    return _watchdog


def _torch_collective_files() -> tuple[str, ...]:
    import torch.distributed as dist

    here = os.path.dirname(os.path.abspath(dist.__file__))
    return tuple(os.path.join(here, name) for name in ("distributed_c10d.py", "c10d_logger.py"))


def _is_work(obj: object) -> bool:
    """A collective's handle (handles.Work is a protocol: any plugin's own type counts)."""
    return callable(getattr(obj, "wait", None)) and callable(getattr(obj, "is_completed", None))


def raised_in_a_collective(exc: BaseException) -> bool:
    """True when `exc` came out of a collective or the wait for one, told by its traceback (a
    frame of torch's collectives, or of a method of a Backend or a Work: any plugin's), never by
    its words: "timed out" in a DataLoader's error is that rank's own failure."""
    import torch.distributed as dist

    from ..backend import Backend

    if isinstance(exc, ShardkitError):
        return False  # shardkit's own refusals (bad sizes, a dtype) are this rank's error
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    torch_files = _torch_collective_files()
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        owner = frame.f_locals.get("self")
        if (os.path.abspath(frame.f_code.co_filename) in torch_files
                or isinstance(owner, Backend) or _is_work(owner)):
            return True
        tb = tb.tb_next
    return False


def on_exception(exc: BaseException, printed: bool = False) -> BaseException:
    """Report an exception that ends this rank; return the exception the rank should end with.

    `printed`: its traceback is out already (this rank's, or the same error's from another rank
    of the node: same_error), so nothing more needs saying if the launcher stops this rank now.

    A collective that failed because a peer died becomes a PeerFailedError naming that peer and
    where this rank was. Any other exception is this rank's own failure: it is posted so every
    peer names this rank, and returned unchanged.
    """
    wd = _watchdog
    if wd is None or isinstance(exc, (PeerFailedError, KeyboardInterrupt)):
        return exc
    if raised_in_a_collective(exc):
        failures = wd.diagnose(wait=min(wd.timeout, 3.0))
        kept = _traceback_note(exc, wd.rank)
        if failures:
            if not wd.claim_report():
                # The watchdog thread said it first and is ending this rank: the collective's
                # own error is only the consequence, not a second story.
                return _reported(PeerFailedError(wd.await_own_exit() or str(exc)))
            message = wd.survivor_message(failures) + kept
            emit(message)
            launcher_record.record(message, "", failed_here=False)
            wd.report_written.set()
            wd.acknowledge(failures)
            wd.linger(failures)
            wd.await_posters(failures)
            return _reported(PeerFailedError(message))
        # This rank ends because of the collective, not on its own: peers must not report its
        # exit as a death (and blame it) while they reach the same conclusion.
        wd.acknowledge()
        said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        message = (f"shardkit: a collective failed on rank {wd.rank} in {where.describe()}, and no "
                   f"other rank failed: {said}. HINT: the ranks probably issued different "
                   "collectives (run with SHARDKIT_DEBUG=1 to name the first difference), or one "
                   f"rank was busy for longer than timeout={wd.timeout:g} s (raise it with "
                   "shardkit.init(timeout=...) or SHARDKIT_TIMEOUT)" + kept)
        emit(message)
        return ShardkitError(message)
    if wd.claim_report():
        launcher_record.record(_headline(exc), _formatted(exc), failed_here=True)
        if printed:
            # The traceback is the report: a SIGTERM from the launcher while post() waits for
            # the peers must not add a "was terminated" one.
            wd.report_written.set()
        wd.post(f"raised {type(exc).__name__}: {exc} (in {where.describe()})")
        wd.report_written.set()  # its own traceback is the report
    else:
        # The watchdog thread reported a peer's failure a moment before this rank raised (the
        # same error, when every rank makes it): it ends this rank once the peers that posted
        # have exited. Leaving now would make this rank the first to exit, which a launcher
        # names the root cause.
        wd.await_own_exit()
    return exc


def _callers_frames(exc: BaseException, tb: Any) -> Any:
    """A refusal of shardkit's own (a ShardkitError) shown from the caller's side: its message
    says what was wrong and what to do, and the frames inside shardkit that raised it would only
    bury the user's line that made the call (SHARDKIT_DEBUG=1 prints them)."""
    if not isinstance(exc, ShardkitError):
        return tb
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    last_outside = None
    node = tb
    while node is not None and not os.path.abspath(node.tb_frame.f_code.co_filename).startswith(
            package + os.sep):
        last_outside, node = node, node.tb_next
    if last_outside is None or node is None:
        return tb
    last_outside.tb_next = None
    wrapped = exc.__cause__ is not None or (exc.__context__ is not None
                                            and not exc.__suppress_context__)
    exc.__cause__, exc.__suppress_context__ = None, True  # its message says what it wrapped
    note = ("(shardkit's own frames" + (" and the error it wrapped" if wrapped else "")
            + " are left out; SHARDKIT_DEBUG=1 prints them)")
    if hasattr(exc, "add_note"):  # Python 3.11+; on 3.10 the shorter traceback goes without it
        exc.add_note(note)
    return tb


def _headline(exc: BaseException) -> str:
    """The exception's type and the first line of its message: the launcher's summary line."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _reported(err: PeerFailedError) -> PeerFailedError:
    err.reported = True
    return err


def _exit_as_survivor(hook: Any, tp: type, value: BaseException, tb: Any) -> None:
    """End a launched rank whose peer failed the same way whichever path reported it first: the
    report is already printed (its traceback kept in a file), and the status tells launchers
    this rank is not the cause."""
    if debugging():
        hook(tp, value, tb)
    abandon_background_saves("a peer failed")  # before the exit functions, which would wait
    atexit._run_exitfuncs()  # os._exit skips them, and the user's may flush logs or files
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed or broken stream: nothing to save
            pass
    os._exit(PEER_FAILED_EXIT)


def _formatted(exc: BaseException) -> str:
    import traceback

    return "".join(traceback.format_exception(exc))


def debugging() -> bool:
    """True when SHARDKIT_DEBUG asks for everything: full tracebacks of failed collectives too."""
    return env_flag(DEBUG_ENV)


def _traceback_note(exc: BaseException, rank: int) -> str:
    """Keep a failed collective's traceback (dozens of lines of C++ frames) in a file; the words
    that end the report say where, so the report stays one line unless SHARDKIT_DEBUG is set."""
    import tempfile

    if debugging():
        return ""
    path = os.path.join(tempfile.gettempdir(), f"shardkit-rank{rank}-pid{os.getpid()}.traceback")
    try:
        with open(path, "w") as f:
            f.write(_formatted(exc))
    except OSError:
        return " (SHARDKIT_DEBUG=1 prints the failed collective's traceback)"
    return f" (the failed collective's traceback: {path}; SHARDKIT_DEBUG=1 prints it here)"


def quiet(original: BaseException, replacement: BaseException) -> bool:
    """True when `replacement` (already printed) stands for `original` and its traceback stays in its file."""
    return replacement is not original and not debugging()


def _excepthook(tp: type, value: BaseException, tb: Any) -> None:
    if getattr(_in_excepthook, "active", False):
        # Called back by the hook it delegates printing to (torch's prefixing wrapper of ours).
        (_original_excepthook or sys.__excepthook__)(tp, value, tb)
        return
    _in_excepthook.active = True
    try:
        _report_uncaught(tp, value, tb)
    finally:
        _in_excepthook.active = False


def _report_uncaught(tp: type, value: BaseException, tb: Any) -> None:
    hook = _previous_excepthook or sys.__excepthook__
    if (interrupt.interrupted() or isinstance(value, KeyboardInterrupt)) and not debugging():
        # A Ctrl-C, or what it caused (a peer's closed socket): the launcher says it once.
        abandon_background_saves("it was interrupted")
        return
    if isinstance(value, PeerFailedError) and value.reported:
        _exit_as_survivor(hook, tp, value, tb)
    if raised_in_a_collective(value):
        # Report first: the one line names the cause, and the collective's own traceback is
        # mostly C++ frames that would bury it.
        replacement = on_exception(value)
        if isinstance(replacement, PeerFailedError) and replacement.reported:
            _exit_as_survivor(hook, tp, value, tb)  # a peer failed: this rank's status says so
        if not quiet(value, replacement):
            hook(tp, value, tb)
        return
    if debugging() or same_error.first_to_report(value):
        hook(tp, value, tb if debugging() else _callers_frames(value, tb))
    if _watchdog is None:  # raised before the job began (init()): the launcher's summary says it
        launcher_record.record(_headline(value), _formatted(value), failed_here=True)
    on_exception(value, printed=True)
