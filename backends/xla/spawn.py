"""`shardkit.spawn(fn, n, backend="xla")`: ranks as torch_xla device threads in one child process.

torch_xla decides how many devices a process has when its runtime starts (CPU_NUM_DEVICES for
PJRT_DEVICE=CPU), and a runtime cannot be restarted, so the ranks run in a fresh child process:
that also keeps an XLA abort (a collective rendezvous timeout ends the whole process) from taking
the caller down with it.
"""

from __future__ import annotations

import concurrent.futures
import faulthandler
import functools
import os
import time
from typing import Any, Callable

from shardkit.errors import ShardkitError

# Every device thread executes its collective graphs on the PJRT CPU client's thread pool; with
# fewer pool threads than devices, a collective waits for a member that cannot run (seen at 3+).
MIN_THREAD_POOL = 8
# Seconds after which the device threads' process prints every thread's stack and exits, so a hung
# collective ends as an error naming where each rank waits (unset: no limit).
TIMEOUT_ENV = "SHARDKIT_XLA_SPAWN_TIMEOUT"


def _device_thread(body: Callable[..., Any], args: tuple) -> Any:
    import torch_xla.runtime as xr

    return body(int(xr.global_ordinal()), *args)


def _child(body: Callable[..., Any], args: tuple, timeout_s: float | None) -> dict[int, Any]:
    from torch_xla._internal import pjrt

    if timeout_s:
        # A C-level watchdog: it fires even while a device thread blocks inside XLA holding the GIL.
        faulthandler.dump_traceback_later(timeout_s, exit=True)

    # What torch_xla.launch does in its child process, minus discarding the return values.
    return pjrt._run_thread_per_device(0, 1, functools.partial(_device_thread, body, args),
                                       pjrt.initialize_multiprocess)


def child_environment(nprocs: int, environ: dict[str, str]) -> dict[str, str]:
    """The variables the child needs for `nprocs` CPU devices (only those that are unset or differ)."""
    if environ.get("PJRT_DEVICE", "").upper() != "CPU":
        return {}
    pool = max(MIN_THREAD_POOL, 2 * nprocs)
    env = {"CPU_NUM_DEVICES": str(nprocs)}
    if int(environ.get("XLA_THREAD_POOL_SIZE", "0") or 0) < pool:
        env["XLA_THREAD_POOL_SIZE"] = str(pool)
    return env


def spawn_timeout(environ: dict[str, str]) -> float | None:
    """The watchdog limit from SHARDKIT_XLA_SPAWN_TIMEOUT (seconds), or None when unset or 0."""
    raw = environ.get(TIMEOUT_ENV, "").strip()
    try:
        value = float(raw) if raw else 0.0
    except ValueError:
        raise ShardkitError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    return value if value > 0 else None


def spawn_device_threads(body: Callable[..., Any], nprocs: int, args: tuple) -> list[Any]:
    """Run body(rank, *args) on `nprocs` device threads of a child process; results in rank order."""
    import torch

    if os.environ.get("PJRT_DEVICE", "").upper() != "CPU":
        raise ShardkitError(
            "shardkit.spawn with backend='xla' runs CPU devices (PJRT_DEVICE=CPU); on TPU start "
            "one rank per chip with `shardkit launch` (torch_xla's launcher). "
            f"PJRT_DEVICE is {os.environ.get('PJRT_DEVICE')!r}")
    extra = child_environment(nprocs, dict(os.environ))
    timeout_s = spawn_timeout(dict(os.environ))
    started = time.monotonic()
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)  # a spawned child copies the parent's environment when it starts
    try:
        context = torch.multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
            results = pool.submit(_child, body, args, timeout_s).result()
    except concurrent.futures.process.BrokenProcessPool as exc:
        if timeout_s and time.monotonic() - started >= timeout_s:
            raise ShardkitError(
                f"the XLA device threads ({nprocs} devices) did not finish within {timeout_s:.0f} s "
                f"({TIMEOUT_ENV}); the stack of every thread, printed above, shows where each rank "
                "waits. HINT: every rank must issue the same collectives in the same order") from exc
        raise ShardkitError(
            f"the XLA device threads' process died ({nprocs} devices); torch_xla aborts the whole "
            "process when a collective's rendezvous times out (10 s). Its stderr above says which "
            "collective. HINT: every rank must issue the same collectives in the same order") from exc
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    if sorted(results) != list(range(nprocs)):
        raise ShardkitError(f"torch_xla ran ranks {sorted(results)}, expected 0..{nprocs - 1}")
    return [results[r] for r in range(nprocs)]
