"""`shardkit.init()`: join the job from whatever launched us and remember the result."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import sys
import threading
from dataclasses import dataclass
from typing import Iterator

import torch

from .. import failure
from ..backend import Backend, DeviceLike
from ..errors import ShardkitError
from ..handles import Group
from ..launch_env import LaunchEnv, restore_environ
from ..logs import logger
from .parent_death import arm_if_launched
from .rendezvous import with_job_store
from .selection import get_backend
from .step_boundary import install_step_hook, remove_step_hook

DEFAULT_TIMEOUT = failure.DEFAULT_TIMEOUT


@dataclass
class DistContext:
    """Everything the engine needs to know about this rank: backend, device, world group."""

    backend: Backend
    env: LaunchEnv
    device: torch.device
    world: Group
    timeout: datetime.timedelta = failure.DEFAULT_TIMEOUT  # what init(timeout=...) resolved to

    @property
    def rank(self) -> int:
        """This rank's index in the world group."""
        return self.world.rank

    @property
    def world_size(self) -> int:
        """Number of ranks in the job."""
        return self.world.size

    @property
    def local_rank(self) -> int:
        """This rank's index on its node."""
        return self.env.local_rank

    def barrier(self) -> None:
        """Block until every rank reaches this call."""
        self.backend.collectives.barrier(self.world)


_thread_local = threading.local()
_process_context: DistContext | None = None
# Contexts init() made that shutdown() has not ended: one per process, or one per device thread
# where ranks are threads. Process-wide hooks go only with the last of them: a device thread that
# finishes first must not pull the optimizer hooks from under the others' step.
_live_contexts = 0
_live_lock = threading.Lock()


def current_context() -> DistContext | None:
    """Return the context `init()` made for this thread (or this process), if any."""
    return getattr(_thread_local, "ctx", None) or _process_context


def _set_current(ctx: DistContext | None) -> None:
    global _process_context
    _thread_local.ctx = ctx
    if ctx is None or not ctx.backend.capabilities.ranks_share_process:
        _process_context = ctx


def init(backend: str | Backend | None = None, timeout: datetime.timedelta | float | None = None,
         device_id: DeviceLike = None, watchdog: bool | None = None) -> DistContext:
    """Initialise the process group from the launcher's environment and return this rank's context.

    timeout (seconds or a timedelta; default SHARDKIT_TIMEOUT, else 30 s on cpu and 10 minutes on
    accelerators) bounds how long a collective waits for its peers and how long a dead peer on
    another host goes unnoticed (one on this host is noticed within a second).
    watchdog (default SHARDKIT_WATCHDOG, on): the per-rank thread that names a failed peer and,
    in a launched rank, ends this one; False leaves failures to the collectives' timeout.
    """
    failure.install_report_hooks()  # before anything here can fail on every rank alike
    enabled = failure.watchdog_requested(watchdog)
    existing = current_context()
    be = get_backend(backend)
    if existing is not None:
        if existing.backend is not be:
            raise ShardkitError(f"shardkit is already initialised with backend "
                                f"{existing.backend.name!r}; call shardkit.shutdown() before "
                                f"initialising {be.name!r}")
        return existing
    timeout = failure.resolve_timeout(timeout, be.capabilities.default_timeout)
    arm_if_launched()  # `shardkit launch` killed, even by SIGKILL: no orphaned ranks
    env = be.devices.launch_env()
    _say_if_no_launcher(be, env)
    device = be.devices.normalize_device(device_id, env.local_rank)
    be.devices.set_device(device)
    world = be.collectives.init_process_group(with_job_store(env, timeout), timeout)
    if be.capabilities.needs_step_boundary:
        install_step_hook(current_context)
    ctx = DistContext(be, env, device, world, timeout)
    logger.info("rank %d/%d (local %d, launcher %s): backend %r on %s, process group %r ready",
                ctx.rank, ctx.world_size, env.local_rank, env.launcher, be.name, device,
                be.collectives.process_group_backend())
    _set_current(ctx)
    _count_contexts(+1)
    failure.start(world.rank, world.size, timeout, be.capabilities.ranks_share_process, enabled)
    if threading.current_thread() is threading.main_thread():
        atexit.unregister(_shutdown_at_exit)  # one entry, however many init()s
        atexit.register(_shutdown_at_exit)
    return ctx


def _say_if_no_launcher(be: Backend, env: LaunchEnv) -> None:
    """One line when a script that could run on several devices here was started without a
    launcher (`python train.py` on an 8-GPU machine trains on one). Silent where one rank is
    clearly meant: a backend with one device here, or one whose ranks share the host's cores (cpu),
    a REPL or notebook."""
    if env.launcher != "none" or failure.interactive():
        return
    devices = be.max_local_ranks()
    if devices is not None and devices > 1:
        logger.warning("no launcher found (no torchrun, mpirun or SLURM variables): this process "
                       "runs as 1 rank, on 1 of the %d %s devices here. HINT: shardkit launch "
                       "--nproc %d %s", devices, be.name, devices,
                       os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "script.py")


def _shutdown_at_exit() -> None:
    # A script that never calls shutdown() (Lightning's Trainer, a forgotten call) leaves torch's
    # process groups to interpreter teardown, where gloo's worker threads drop finished
    # collectives whose tensors refer to Python objects: a rank that finished its work could
    # abort with "terminate called without an active exception" (SIGABRT), and its launcher
    # report the job failed (issue 39). Destroy them while the interpreter is whole. A process
    # ending with an uncaught exception is left to the failure paths (a peer may be gone).
    if getattr(sys, "last_value", None) is not None or _process_context is None:
        return
    try:
        shutdown()
    except Exception as exc:  # noqa: BLE001 - the process is ending; say why, once
        logger.warning("shutdown at exit failed: %s: %s", type(exc).__name__, exc)


@contextlib.contextmanager
def acting_context(ctx: DistContext) -> Iterator[DistContext]:
    """Make `ctx` this thread's context for the block, then put back what was there.

    For the planner's rehearsal (planner/rehearsal.py): shard() then runs against a context
    init() never made, which joins no job and counts as no live context; the process-wide hooks
    shard() installs go with it unless a real job is still live."""
    previous = getattr(_thread_local, "ctx", None)
    _thread_local.ctx = ctx
    try:
        yield ctx
    finally:
        _thread_local.ctx = previous
        if _count_contexts(0) == 0:
            _remove_job_hooks()


def require_context(backend: str | Backend | None = None) -> DistContext:
    """Return the current context, initialising one (from the environment) if there is none."""
    ctx = current_context()
    if ctx is None:
        return init(backend)
    if backend is not None and get_backend(backend) is not ctx.backend:
        raise ShardkitError(f"backend {backend!r} was requested but shardkit was initialised with "
                            f"{ctx.backend.name!r}; pass the same backend or none")
    return ctx


def shutdown() -> None:
    """Tear down the process group made by `init()` and forget the context.

    Background checkpoint saves this process started are waited for first (unless an exception
    is on its way out: a peer may be gone, and the previous checkpoint stays the valid one).

    Called while an exception is on its way out (the `finally: shardkit.shutdown()` of a failing
    loop, or an `except` block), it first reports that exception as an uncaught one would be: a
    rank's own error is posted so its peers name it, and a collective that failed because of a
    peer is re-raised as the PeerFailedError naming that peer (chained to the original).
    """
    import sys

    ctx = current_context()
    in_flight = sys.exc_info()[1]
    replacement = None
    writer = sys.modules.get("shardkit.checkpoint.background")
    if writer is not None and in_flight is None:
        # A job's last save(background=True) completes before the job ends (a rank that
        # multiprocessing started never runs atexit handlers).
        writer.wait_pending()
    elif writer is not None:
        # Leaving with an exception (`finally: shutdown()`): the peers this save needs may be
        # gone, and waiting took the write timeout (issue 39). The previous checkpoint stays.
        writer.abandon_pending(f"shutdown() during {type(in_flight).__name__}")
    if ctx is not None:
        if in_flight is not None:
            # Once the watchdog is stopped below, this rank's failure could no longer be told
            # to its peers, and the report would be gloo's last words instead of shardkit's.
            replacement = failure.on_exception(in_flight)
        failure.stop(leaving_with=replacement)
        ctx.backend.collectives.shutdown()
    _set_current(None)
    if _count_contexts(-1 if ctx is not None else 0) == 0:
        _remove_job_hooks()
        restore_environ()
        atexit.unregister(_shutdown_at_exit)
    if in_flight is not None and replacement is not None and replacement is not in_flight:
        if failure.quiet(in_flight, replacement):
            raise replacement from None  # the original's traceback is in the file it names
        raise replacement from in_flight


def _count_contexts(change: int) -> int:
    """Add `change` to the live contexts; return how many are left."""
    global _live_contexts
    with _live_lock:
        _live_contexts = max(0, _live_contexts + change)
        return _live_contexts


def _remove_job_hooks() -> None:
    # The torch.optim hooks, torch's total-norm replacement and the DTensor .item() refusal that
    # init() and shard() installed go with the job (process_state.py); the next init() / shard()
    # installs them again.
    remove_step_hook()
    for name, remove in (("shardkit.sharding.setup.stale_optimizer", "uninstall"),
                         ("shardkit.sharding.surface.local_step", "uninstall"),
                         ("shardkit.sharding.surface.torch_norms", "uninstall"),
                         ("shardkit.sharding.step.whole_view", "allow_partial_items"),
                         ("shardkit.sharding.step.whole_view", "forget_released_meshes")):
        module = sys.modules.get(name)
        if module is not None:
            getattr(module, remove)()


def reset_context() -> None:
    """Shut down the job this process (or device thread) joined, if any (process_state.reset)."""
    if current_context() is not None:
        shutdown()
    global _live_contexts
    with _live_lock:  # device threads that never shut down (a test failed in one) end here too
        _live_contexts = 0
    _remove_job_hooks()
    restore_environ()
