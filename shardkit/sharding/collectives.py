"""Pure helpers for one unit's flat collectives: copy-in, collective, copy-out, and divide factors.

Every flat buffer is laid out (group_size, unit_shard_numel): row r holds, param after param,
the r-th shard of each parameter. All-gather fills all rows from each rank's own row;
reduce-scatter leaves row `rank` summed over the group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..backend import Backend
from ..handles import Group, Work
from .buffers import BufferPool
from .comm_stats import CommStats
from .param import ShardedParam


_NO_POOL = BufferPool(enabled=False, max_buffers=0)


def column_offsets(params: Sequence[ShardedParam]) -> list[int]:
    """Start column of each parameter inside a row of the unit's flat buffer."""
    offsets, at = [], 0
    for p in params:
        offsets.append(at)
        at += p.shard_numel
    return offsets


@dataclass
class PendingGather:
    """An all-gather in flight: wait on `work` (and `event`), then copy `output` out."""

    work: Work
    output: torch.Tensor
    input: torch.Tensor  # this rank's row of `output`
    event: Any = None  # recorded on the gather stream after the collective was queued

    def wait(self, backend: Backend, device: torch.device) -> None:
        """Make the compute stream see the gathered data (blocks the host where there are no streams)."""
        self.work.wait()
        current = backend.current_stream(device)
        if self.event is not None:
            current.wait_event(self.event)
        # The output was allocated on the gather stream; copy-out reads it on the compute stream.
        backend.record_stream(self.output, current)


def start_all_gather(params: Sequence[ShardedParam], dtype: torch.dtype, device: torch.device,
                     group: Group, backend: Backend, stats: CommStats | None,
                     async_op: bool, stream: Any = None,
                     pool: BufferPool | None = None,
                     out: torch.Tensor | None = None) -> PendingGather:
    """Copy this rank's shards (cast to `dtype`) into one flat input and start the all-gather.

    With a separate gather `stream`, copy-in and the collective run there so they overlap with
    compute; the stream first waits for the compute stream (the optimizer may just have written
    the shards). `out`, if given, is the flat output to gather into instead of a pool buffer.
    """
    stream = stream if stream is not None else backend.current_stream(device)
    stream.wait_stream(backend.current_stream(device))
    with backend.use_stream(stream):
        pool = pool or _NO_POOL
        row = sum(p.shard_numel for p in params)
        if out is None:
            out = pool.take(group.size * row, dtype, device)
        # Copy-in straight into this rank's row of the output (an in-place all-gather): no
        # separate input buffer, one copy fewer.
        inp = out[group.rank * row:(group.rank + 1) * row]
        for p, at in zip(params, column_offsets(params)):
            inp[at:at + p.shard_numel].copy_(p.sharded.detach(), non_blocking=True)
        if stats is not None:
            stats.all_gather(inp.numel() * inp.element_size(), group.size)
        work = backend.all_gather_into_tensor(out, inp, group, async_op=async_op)
        event = backend.new_event()
        event.record(stream)
    return PendingGather(work, out, inp, event)


def copy_out(params: Sequence[ShardedParam], output: torch.Tensor, targets: Sequence[torch.Tensor],
             group_size: int) -> None:
    """Copy each parameter's real elements from the gathered rows into its full-shape target."""
    rows = output.view(group_size, -1)
    for p, at, target in zip(params, column_offsets(params), targets):
        flat = target.view(-1)
        for r in range(group_size):
            n = p.rank_valid(r)
            if n:
                flat[r * p.shard_numel:r * p.shard_numel + n].copy_(rows[r, at:at + n])


def gather_full(params: Sequence[ShardedParam], dtype: torch.dtype, device: torch.device,
                group: Group, backend: Backend, stats: CommStats | None) -> list[torch.Tensor]:
    """Return fresh full tensors (original shapes, `dtype`) of `params`; synchronous."""
    pending = start_all_gather(params, dtype, device, group, backend, stats, async_op=False)
    pending.wait(backend, device)  # fresh buffers (no pool): the caller may keep views
    fulls = [torch.empty(p.full_shape, dtype=dtype, device=device) for p in params]
    copy_out(params, pending.output, fulls, group.size)
    return fulls


def divide_factors(world: int, dtype: torch.dtype) -> tuple[float, float]:
    """Split the 1/world averaging into a pre- and post-reduction factor.

    fp16 sums overflow easily, so it divides by about sqrt(world) before and the rest after;
    other dtypes sum first and divide once (exactly the mean's rounding).
    """
    if dtype != torch.float16 or world <= 1:
        return 1.0, float(world)
    pre = max(d for d in range(1, math.isqrt(world) + 1) if world % d == 0)
    return float(pre), float(world // pre)


@dataclass
class PendingReduce:
    """A reduce-scatter in flight for one unit bucket."""

    params: list[ShardedParam]
    work: Work
    output: torch.Tensor
    input: torch.Tensor  # kept alive until the collective finished reading it
    post_divide: float
    event: Any = None  # recorded on the reduce stream after the collective was queued
    pooled: bool = True  # whether `input` came from the buffer pool (else it is a dead grad)


def pack_grads(params: Sequence[ShardedParam], grads: Sequence[torch.Tensor | None],
               dtype: torch.dtype, device: torch.device, group_size: int, pre_divide: float,
               pool: BufferPool | None = None) -> torch.Tensor:
    """Copy full gradients (zeros where None) into the (group_size, row) reduce-scatter input."""
    pool = pool or _NO_POOL
    row = sum(p.shard_numel for p in params)
    inp = pool.take(group_size * row, dtype, device).view(group_size, row)
    for p, at, grad in zip(params, column_offsets(params), grads):
        flat = grad.reshape(-1) if grad is not None else None
        for r in range(group_size):
            n = p.rank_valid(r) if flat is not None else 0
            if n:
                inp[r, at:at + n].copy_(flat[r * p.shard_numel:r * p.shard_numel + n])
            if n < p.shard_numel:  # padding (or a missing grad) must reduce as zeros
                inp[r, at + n:at + p.shard_numel].zero_()
    if pre_divide != 1.0:
        inp.div_(pre_divide)
    return inp


def start_reduce_scatter(params: Sequence[ShardedParam], inp: torch.Tensor, device: torch.device,
                         group: Group, backend: Backend, stats: CommStats | None,
                         post_divide: float, stream: Any = None,
                         pooled: bool = True) -> PendingReduce:
    """Start the sum reduce-scatter of a packed input; this rank's row lands in the output."""
    # Packing ran on the compute stream (where the grads were made); the collective runs on the
    # reduce stream so the next unit's backward can proceed.
    stream = stream if stream is not None else backend.current_stream(device)
    stream.wait_stream(backend.current_stream(device))
    backend.record_stream(inp, stream)
    with backend.use_stream(stream):
        out = torch.empty(inp.shape[1], dtype=inp.dtype, device=device)
        if stats is not None:
            stats.reduce_scatter(out.numel() * out.element_size(), group.size)
        work = backend.reduce_scatter_tensor(out, inp.view(-1), group, op="sum", async_op=True)
        event = backend.new_event()
        event.record(stream)
    return PendingReduce(list(params), work, out, inp, post_divide, event, pooled)


def finish_reduce(pending: PendingReduce, replica: Group | None, backend: Backend,
                  stats: CommStats | None, pool: BufferPool | None = None) -> None:
    """Wait for the reduce-scatter, sum across replicas, divide, and add into the sharded grads."""
    pending.work.wait()
    device = pending.output.device
    current = backend.current_stream(device)
    if pending.event is not None:
        current.wait_event(pending.event)
    out = pending.output
    backend.record_stream(out, current)
    if replica is not None and replica.size > 1:
        if stats is not None:
            stats.all_reduce(out.numel() * out.element_size(), replica.size)
        backend.all_reduce(out, replica, op="sum").wait()
    if pending.post_divide != 1.0:
        out.div_(pending.post_divide)
    if pool is not None and pending.pooled:
        pool.give(pending.input)
    for p, at in zip(pending.params, column_offsets(pending.params)):
        p.accumulate_grad(out[at:at + p.shard_numel])
