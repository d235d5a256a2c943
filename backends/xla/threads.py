"""Coordination of XLA ranks that are threads of one process (PJRT_DEVICE=CPU, torch_xla 2.9).

torch_xla runs N CPU devices as N threads of one process. A collective only completes when every
thread executes the *same compiled executable*: two threads that compile the same graph at the
same moment get different collective op ids, never meet, and XLA aborts the whole process after
10 s (a timeout no flag raises in 2.9). The rules that make it reliable:

- every collective runs in its own small graph: pending work on its inputs is flushed first, so the
  graph holds only the collective and nothing rank-dependent;
- before that graph is compiled, all member threads have traced it (a threading.Barrier), and
  compiles/dispatches are serialised by one process-wide lock, so the first thread compiles and the
  others hit the compilation cache (same executable, same op id);
- the wait for the result happens outside the lock: a thread blocked inside sync() while holding the
  lock would keep the other members from dispatching their half of the collective.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Sequence

import torch

from shardkit.errors import ShardkitError

# A rank that raised never arrives; the others give up after this long instead of hanging.
BARRIER_TIMEOUT_S = 300.0
# One lock for every graph compile and dispatch of every device thread in this process.
_COMPILE_LOCK = threading.Lock()
_REGISTRY_LOCK = threading.Lock()
# (ranks, per-thread creation index) -> the barrier the member threads share.
_GROUP_BARRIERS: dict[tuple[tuple[int, ...], int], threading.Barrier] = {}


@dataclass
class ThreadGroup:
    """One rank's view of a group whose members are threads of this process (a Group.handle)."""

    rank: int  # global rank of this thread
    ranks: tuple[int, ...]
    device: torch.device
    barrier: threading.Barrier | None  # None for a multi-process world (no threads to meet)
    replica_groups: list[list[int]] = field(default_factory=list)  # [] means all ranks

    def meet(self) -> None:
        """Block until every member thread reaches this point (no-op across processes)."""
        if self.barrier is not None:
            try:
                self.barrier.wait(BARRIER_TIMEOUT_S)
            except threading.BrokenBarrierError:
                raise ShardkitError(
                    f"rank {self.rank}: the other ranks of group {list(self.ranks)} did not reach "
                    f"the same collective within {BARRIER_TIMEOUT_S:.0f} s (one of them failed or "
                    "issued different collectives)") from None


def shared_barrier(ranks: tuple[int, ...], index: int) -> threading.Barrier:
    """Return the barrier every member thread of group number `index` over `ranks` shares."""
    with _REGISTRY_LOCK:
        key = (ranks, index)
        if key not in _GROUP_BARRIERS:
            _GROUP_BARRIERS[key] = threading.Barrier(len(ranks))
        return _GROUP_BARRIERS[key]


def reset_barriers() -> None:
    """Forget every shared barrier: they belong to one run of device threads (shardkit_reset_state)."""
    with _REGISTRY_LOCK:
        _GROUP_BARRIERS.clear()


def _real_device(device: torch.device) -> str:
    import torch_xla.core.xla_model as xm

    return xm.xla_real_devices([str(device)])[0]


def use_device(device: torch.device) -> None:
    """Make `device` this thread's default XLA device (autograd runs backward hooks in its own threads)."""
    import torch_xla

    if torch_xla._XLAC._xla_get_default_device() != str(device):
        torch_xla._XLAC._xla_set_default_device(str(device))


def _execute(tensors: Sequence[torch.Tensor], device: torch.device) -> None:
    import torch_xla

    with _COMPILE_LOCK:
        torch_xla._XLAC._xla_sync_multi(list(tensors), devices=[str(device)], wait=False,
                                        sync_xla_data=True)
        # The token chains collectives inside one graph; this graph is done, so start a new chain
        # (a stale token would pull the finished collective into the next graph again).
        torch_xla._XLAC._set_all_reduce_token(str(device), None)
    wait_device(device)


def flush(tensors: Sequence[torch.Tensor], device: torch.device) -> None:
    """Execute the pending graph behind `tensors` (no collectives in it) and wait for it."""
    _execute(tensors, device)


def wait_device(device: torch.device) -> None:
    """Block (without the lock or the GIL) until every graph dispatched to `device` has run."""
    import torch_xla

    torch_xla._XLAC._xla_wait_device_ops([_real_device(device)])


def run_collective_graph(outputs: Sequence[torch.Tensor], group: ThreadGroup) -> None:
    """Compile and dispatch the graph producing `outputs` in step with the other members, then wait."""
    group.meet()  # every member has traced the same graph: the first compiles, the rest reuse it
    _execute(outputs, group.device)


def sync_device(device: torch.device) -> None:
    """Cut and run everything pending on `device` (the step boundary), serialised with compiles."""
    import torch_xla

    with _COMPILE_LOCK:
        torch_xla._XLAC._xla_step_marker(str(device), [], wait=False)
        torch_xla._XLAC._set_all_reduce_token(str(device), None)
    wait_device(device)
