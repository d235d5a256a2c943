"""`shardkit.spawn()`: run a function on N local ranks without any distributed ceremony."""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import signal
import socket
import tempfile
import time
import traceback
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

from typing_extensions import override

from ..errors import PeerFailedError, ShardkitError
from ..launch_env import SPAWN_JOB_PREFIX

if TYPE_CHECKING:
    from ..backend import Backend


class SpawnError(ShardkitError):
    """One or more ranks of shardkit.spawn failed; the message has each rank's own report."""

    def __init__(self, message: str, exitcodes: dict[int, int], exit_times: dict[int, float],
                 reports: dict[int, str]) -> None:
        super().__init__(message)
        self.exitcodes = exitcodes  # rank -> exit status (negative: killed by that signal)
        self.exit_times = exit_times  # rank -> time.time() when the parent saw it exit
        self.reports = reports  # rank -> what it wrote before exiting (traceback, failure report)


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on `host` that nothing is listening on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _rank_body(local_rank: int, fn: Callable, backend: Any, args: tuple,
               timeout: datetime.timedelta | float | None = None) -> Any:
    from .. import failure
    from . import runtime

    runtime.init(backend, timeout=timeout)
    try:
        return fn(local_rank, *args)
    except BaseException as exc:
        # Name the culprit: this rank's own error is posted for its peers; a collective that
        # failed because a peer died becomes a PeerFailedError naming that peer.
        raised = failure.on_exception(exc)
        if raised is exc:
            raise
        raise raised from exc
    finally:
        runtime.shutdown()


def _rank_main(local_rank: int, fn: Callable, nprocs: int, port: int, backend: Any,
               args: tuple, threads: int | None, result_dir: str,
               timeout: datetime.timedelta | float | None = None,
               caller: _CallerState | None = None, caller_pid: int | None = None) -> None:
    from .parent_death import end_with_process

    # Started with SIGINT blocked and ignored (_ctrl_c_left_to_caller): still ignored, but a
    # handler the user's function installs must receive it.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    # A SIGTERM or SIGKILL of the caller must not leave this rank training as an orphan.
    if caller_pid is not None:
        end_with_process(caller_pid)
    if caller is not None:
        caller.apply()
        if threads is None:
            threads = _omp_threads(caller.environ)
    error_file = os.path.join(result_dir, f"rank{local_rank}.err")
    os.environ.update({"RANK": str(local_rank), "WORLD_SIZE": str(nprocs),
                       "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(nprocs),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "SHARDKIT_ERROR_FILE": error_file,
                       # The result directory is unique to this spawn: its name names the job.
                       "SHARDKIT_JOB_ID": f"{SPAWN_JOB_PREFIX}{os.path.basename(result_dir)}"})
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    try:
        value = _rank_body(local_rank, fn, backend, args, timeout)
    except PeerFailedError:
        from ..failure import PEER_FAILED_EXIT

        # Its report is written already; the status tells the parent it is not the culprit.
        raise SystemExit(PEER_FAILED_EXIT) from None
    except BaseException as exc:
        with open(error_file, "a") as f:
            f.write("".join(traceback.format_exception(exc)))
        raise
    # A file, not a queue: a child blocked on a full pipe would never exit and join would hang.
    with open(os.path.join(result_dir, f"rank{local_rank}.pkl"), "wb") as f:
        pickle.dump(value, f)


def spawn(fn: Callable[..., Any], nprocs: int, *args: Any, backend: str | Backend | None = None,
          threads_per_rank: int | None = None,
          timeout: datetime.timedelta | float | None = None,
          start_method: str | None = None) -> list[Any]:
    """Run ``fn(rank, *args)`` on `nprocs` local processes with shardkit initialised; return their results in rank order.

    If a rank fails, the others stop within `timeout` (see shardkit.init) and this raises a
    SpawnError with every rank's report: the failed rank's traceback and where the rest were.
    `start_method` is "forkserver" (the default where the platform has it: ranks fork from a
    server that imported torch once, so each spawn skips seconds of imports per rank) or "spawn"
    (a fresh interpreter per rank).
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ShardkitError(f"nprocs must be a positive integer, got {nprocs!r}")
    method = _start_method(start_method)
    try:
        pickle.dumps((fn, args))
    except Exception as exc:
        raise ShardkitError(
            f"spawn needs a function and arguments that pickle (ranks run in other processes): "
            f"{exc}. Define the function at module level, not as a lambda or nested function, "
            "and guard the call with `if __name__ == '__main__':`") from exc
    from ..backend import check_local_ranks
    from .selection import get_backend

    # Refused here, before any rank starts: past it, the device library fails inside the ranks.
    check_local_ranks(get_backend(backend), nprocs)
    if backend is not None:
        # A backend whose ranks are not processes (XLA device threads) starts them itself.
        results = get_backend(backend).devices.spawn_ranks(_rank_body, nprocs, (fn, backend, args))
        if results is not None:
            return results
    from ..failure import DEFAULT_ACCELERATOR_TIMEOUT, resolve_timeout

    grace = resolve_timeout(timeout, DEFAULT_ACCELERATOR_TIMEOUT).total_seconds() + 15.0
    with tempfile.TemporaryDirectory(prefix="shardkit-spawn-") as result_dir:
        caller = _CallerState(dict(os.environ)) if method == "forkserver" else None
        context = _start_ranks(method, (fn, nprocs, free_port(), backend, args, threads_per_rank,
                                        result_dir, timeout, caller, os.getpid()))
        _join(context.processes, grace, result_dir)
        out = []
        for rank in range(nprocs):
            with open(os.path.join(result_dir, f"rank{rank}.pkl"), "rb") as f:
                out.append(pickle.load(f))
        return out


START_METHODS = ("forkserver", "spawn")


def _start_ranks(method: str, rank_args: tuple) -> Any:
    """Start the rank processes (ignoring Ctrl-C, see below) and return torch's process context."""
    import torch.multiprocessing as mp

    def start() -> Any:
        return mp.start_processes(_rank_main, nprocs=rank_args[1], join=False, start_method=method,
                                  args=rank_args)

    if method != "forkserver":
        with _ctrl_c_left_to_caller():
            return start()
    from multiprocessing import forkserver

    # The server is born ignoring SIGINT (its Python start-up and the package imports before its
    # first preloaded module, shardkit/_ignore_ctrl_c.py, printed a KeyboardInterrupt traceback
    # when a Ctrl-C landed there) and its ranks inherit that; the caller's own Ctrl-C meanwhile
    # stays pending and reaches its handler once the server is started.
    with _ctrl_c_left_to_caller():
        forkserver.ensure_running()
    return start()


@contextlib.contextmanager
def _ctrl_c_left_to_caller() -> Iterator[None]:
    """Start processes that ignore SIGINT (ranks of the spawn start method, and the forkserver):
    Ctrl-C reaches the whole terminal group, and the caller alone answers it
    (its KeyboardInterrupt stops every rank), instead of each rank, halfway through importing
    torch, printing a traceback of its own."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be changed from the main thread
        return
    # Blocked first: a Ctrl-C while the children start stays pending (Linux keeps a blocked
    # signal even when ignored) and reaches the restored handler below, instead of being lost
    # to SIG_IGN. Children inherit both; ranks unblock it at their start (_rank_main).
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited through fork and exec
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _start_method(requested: str | None) -> str:
    """The start method to use: `requested`, else forkserver where the platform has it, else spawn."""
    import multiprocessing

    available = [m for m in START_METHODS if m in multiprocessing.get_all_start_methods()]
    method = requested if requested is not None else available[0]
    if method not in available:
        raise ShardkitError(f"start_method must be one of {', '.join(available)} on this platform, "
                            f"got {requested!r}")
    if method == "forkserver":
        from multiprocessing import forkserver

        # Importing torch is most of a rank's start-up (seconds, more on a busy machine): the
        # server does it once and every rank of every later spawn forks from it. Modules a
        # caller asked the server to preload stay; none of this changes a running server.
        preload = list(getattr(getattr(forkserver, "_forkserver", None), "_preload_modules", None) or [])
        ours = ("shardkit._ignore_ctrl_c", "torch")  # first: SIGINT ignored before torch loads
        forkserver.set_forkserver_preload([ours[0]] + [m for m in preload if m != ours[0]]
                                          + [m for m in ours[1:] if m not in preload])
    return method


class _CallerState:
    """The caller's environment, stdout and stderr as they are now, for a rank forked from the forkserver.

    Such a rank otherwise starts with the server's (the caller's when the server started, which a
    test's output capture or a later redirect has replaced since): pickled as each rank starts, this
    carries the current ones.
    """

    def __init__(self, environ: dict[str, str], fds: tuple[Any, ...] = ()) -> None:
        self.environ = environ
        self.fds = fds

    @override
    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing import reduction

        # DupFd while the rank's process object is pickled: the fd travels with it to the child.
        fds = tuple(reduction.DupFd(fd) if _is_open(fd) else None for fd in (1, 2))
        return (_CallerState, (self.environ, fds))

    def apply(self) -> None:
        """In the rank: take the caller's environment and write to the caller's stdout and stderr."""
        import sys

        os.environ.clear()
        os.environ.update(self.environ)
        for target, stream, wrapped in zip((1, 2), (sys.stdout, sys.stderr), self.fds):
            if wrapped is not None:
                if stream is not None:
                    stream.flush()
                fd = wrapped.detach()
                os.dup2(fd, target)
                os.close(fd)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _omp_threads(environ: dict[str, str]) -> int | None:
    """The thread count OMP_NUM_THREADS asks for (torch read the server's when the server started)."""
    try:
        value = int(environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return None
    return value if value > 0 else None


def _join(processes: list, grace: float, result_dir: str) -> None:
    """Wait for every rank; once one fails, give the rest `grace` seconds to report, then stop them."""
    pending = dict(enumerate(processes))
    exit_times: dict[int, float] = {}
    try:
        _wait_all(pending, exit_times, grace)
    finally:
        _kill_all(pending.values())  # interrupted: leave no rank running
    codes = {rank: proc.exitcode for rank, proc in enumerate(processes)}
    if any(codes.values()):
        raise _spawn_error(codes, exit_times, result_dir)


def _kill_all(processes: Iterable[Any]) -> None:
    """SIGKILL every process, then reap them: killed one by one, a rank still alive would see its
    peer vanish and print a "rank N died" report (after a Ctrl-C that stopped them all)."""
    processes = list(processes)
    for proc in processes:
        proc.kill()
    for proc in processes:
        proc.join()


def _wait_all(pending: dict, exit_times: dict[int, float], grace: float) -> None:
    from multiprocessing.connection import wait

    deadline = None
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = set(wait([p.sentinel for p in pending.values()], timeout=left))
        now = time.time()
        for rank, proc in list(pending.items()):
            if proc.sentinel in ready:
                proc.join()
                exit_times[rank] = now
                del pending[rank]
                if proc.exitcode != 0 and deadline is None:
                    deadline = time.monotonic() + grace
        if deadline is not None and pending and time.monotonic() >= deadline:
            _kill_all(pending.values())
            for rank in pending:
                exit_times[rank] = time.time()
            pending.clear()


def _spawn_error(codes: dict[int, int], exit_times: dict[int, float], result_dir: str) -> SpawnError:
    from ..failure import PEER_FAILED_EXIT

    reports = {}
    for rank in codes:
        try:
            with open(os.path.join(result_dir, f"rank{rank}.err")) as f:
                reports[rank] = f.read().strip()
        except OSError:
            reports[rank] = ""
    lines = []
    # Culprits first: the ranks that did not stop because of somebody else.
    for rank in sorted(codes, key=lambda r: (codes[r] in (0, PEER_FAILED_EXIT), r)):
        code = codes[rank]
        if code == 0:
            continue
        if code < 0:
            status = f"process {rank} terminated with signal {signal.Signals(-code).name}"
        else:
            status = f"process {rank} exited with status {code}"
        lines.append(f"rank {rank}: {status}" + (f"\n{reports[rank]}" if reports[rank] else ""))
    return SpawnError("shardkit.spawn: a rank failed\n" + "\n".join(lines), codes, exit_times,
                      reports)
