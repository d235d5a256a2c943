"""Pure helpers for one unit's flat collectives: copy-in, collective, copy-out (divide factors: reduce_ops).

Every flat buffer is laid out (group_size, unit_shard_numel): row r holds, param after param,
the r-th shard of each parameter. All-gather fills all rows from each rank's own row;
reduce-scatter leaves row `rank` summed over the group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

from ...backend import Backend
from ...handles import Group, Work
from .buffers import BufferPool
from .traffic import CommStats
from .param import ShardedParam
from .trace import trace_range

if TYPE_CHECKING:
    from .reduce_ops import ReducePlan


def factor_kwargs(factor: float | None) -> dict[str, float]:
    """`factor=` for a collective only when there is one: plugins written before it keep working."""
    return {} if factor is None else {"factor": factor}

_NO_POOL = BufferPool(enabled=False, max_buffers=0)


def row_sizes(params: Sequence[ShardedParam]) -> list[int]:
    """Elements each parameter takes in one row of the unit's flat buffer (its shard size)."""
    return [p.shard_numel for p in params]


@dataclass
class PendingGather:
    """An all-gather in flight: wait on `work` (and `event`), then copy `output` out."""

    work: Work
    output: torch.Tensor
    input: torch.Tensor  # this rank's row of `output`
    event: Any = None  # recorded on the gather stream after the collective was queued
    into_storage: bool = False  # `output` is a direct bucket's own param storage: no copy-out

    def wait(self, backend: Backend, device: torch.device) -> None:
        """Make the compute stream see the gathered data (blocks the host where there are no streams)."""
        current = backend.current_stream(device)
        if self.event is not None:  # before the work's wait: see reduced_row
            current.wait_event(self.event)
        self.work.wait()
        # The output was allocated on the gather stream; copy-out reads it on the compute stream.
        backend.record_stream(self.output, current)


def start_all_gather(params: Sequence[ShardedParam], dtype: torch.dtype, device: torch.device,
                     group: Group, backend: Backend, stats: CommStats | None,
                     async_op: bool, stream: Any = None,
                     pool: BufferPool | None = None,
                     source: torch.Tensor | None = None,
                     into: torch.Tensor | None = None) -> PendingGather:
    """Copy this rank's shards (cast to `dtype`) into one flat input and start the all-gather.

    With a separate gather `stream`, copy-in and the collective run there so they overlap with
    compute; the stream first waits for the compute stream (the optimizer may just have written
    the shards). `source`, when given, is this rank's ready-made row instead of the shards (the
    slice kept by reshard_after_forward=k, gathered over the k-rank `group`). `into`, when given,
    is the output (a direct bucket's padded flat storage) instead of a pooled buffer.
    """
    stream = stream if stream is not None else backend.current_stream(device)
    stream.wait_stream(backend.current_stream(device))
    if source is not None:
        backend.record_stream(source, stream)  # the caller drops it while the copy is queued
    with backend.use_stream(stream):
        pool = pool or _NO_POOL
        sizes = row_sizes(params)
        row = sum(sizes) if source is None else source.numel()
        out = into if into is not None else pool.take(group.size * row, dtype, device)
        # Copy-in straight into this rank's row of the output (an in-place all-gather): no
        # separate input buffer, one copy fewer.
        inp = out[group.rank * row:(group.rank + 1) * row]
        with trace_range("shardkit::copy_in"):
            if source is None:
                copy_in(params, inp, sizes)
            else:
                inp.copy_(source)
        if stats is not None:
            stats.all_gather(inp.numel() * inp.element_size(), group.size,
                             stats.crosses_node(group))
        with trace_range("shardkit::all_gather"):
            work = backend.all_gather_into_tensor(out, inp, group, async_op=async_op)
        event = backend.new_event()
        event.record(stream)
    return PendingGather(work, out, inp, event, into_storage=into is not None)


def copy_in(params: Sequence[ShardedParam], inp: torch.Tensor, sizes: Sequence[int]) -> None:
    """Cast and copy every shard into its columns of `inp` in one fused (foreach) copy."""
    shards = [p.shard_flat() for p in params]
    if len(shards) == 1:
        inp.copy_(shards[0])
        return
    # One foreach copy casts to the row's dtype on the way: the unit is cast once, not per
    # parameter through temporaries.
    torch._foreach_copy_(list(torch.split(inp, list(sizes))), shards)


def copy_out(params: Sequence[ShardedParam], output: torch.Tensor,
             targets: Sequence[torch.Tensor], group_size: int) -> None:
    """Scatter the gathered rows into each parameter's padded flat target (one fused copy).

    Each target holds `padded_numel` elements, i.e. (group_size, padded_numel / group_size)
    rank-major, exactly the columns of the parameter in every row, so padding lands in the
    targets' unused tail (group_size is the shard group's, or k after a reshard to k ranks).
    """
    rows = output.view(group_size, -1)
    outs = [t.view(group_size, -1) for t in targets]
    with trace_range("shardkit::copy_out"):
        if len(outs) == 1:
            outs[0].copy_(rows)
        else:
            torch.split_with_sizes_copy(rows, [o.shape[1] for o in outs], dim=1, out=outs)


def gather_full(params: Sequence[ShardedParam], dtype: torch.dtype, device: torch.device,
                group: Group, backend: Backend, stats: CommStats | None) -> list[torch.Tensor]:
    """Return fresh full tensors (original shapes, `dtype`) of `params`; synchronous."""
    pending = start_all_gather(params, dtype, device, group, backend, stats, async_op=False)
    pending.wait(backend, device)  # fresh buffers (no pool): the caller may keep views
    flats = [torch.empty(p.padded_numel, dtype=dtype, device=device) for p in params]
    copy_out(params, pending.output, flats, group.size)
    # A padded buffer would drag its tail into whatever keeps the tensor (a saved file).
    return [f.view(p.full_shape) if p.numel == p.padded_numel
            else f[:p.numel].clone().view(p.full_shape) for p, f in zip(params, flats)]


@dataclass
class PendingReduce:
    """A reduce-scatter in flight for one unit bucket."""

    params: list[ShardedParam]
    work: Work
    output: torch.Tensor
    input: torch.Tensor  # kept alive until the collective finished reading it
    plan: "ReducePlan"
    event: Any = None  # recorded on the reduce stream after the collective was queued
    pooled: bool = True  # `input` came from the buffer pool (not a direct bucket's own grad)
    group: Group | None = None  # the shard group it reduced over


def pack_grads(params: Sequence[ShardedParam], grads: Sequence[torch.Tensor | None],
               dtype: torch.dtype, device: torch.device, group_size: int, pre_divide: float,
               pool: BufferPool | None = None) -> torch.Tensor:
    """Copy full gradients (zeros where None) into the (group_size, row) reduce-scatter input.

    One `_chunk_cat` casts to `dtype`, splits each grad into its per-rank shards, zero-pads them
    and lays them out rank-major: the whole unit in one kernel where the device has one.
    """
    pool = pool or _NO_POOL
    row = sum(p.shard_numel for p in params)
    inp = pool.take(group_size * row, dtype, device).view(group_size, row)
    chunks = []
    for p, grad in zip(params, grads):
        if grad is None:  # an unused parameter reduces as zeros
            chunks.append(torch.zeros(p.padded_numel, dtype=dtype, device=device))
            continue
        flat = grad.reshape(-1)
        if p.numel and -(-p.numel // group_size) == p.shard_numel:
            chunks.append(flat)  # _chunk_cat pads the last shards exactly as the layout does
        else:  # aligned shards are wider than _chunk_cat's ceil(numel / group): pad by hand
            chunks.append(torch.nn.functional.pad(flat, (0, p.padded_numel - p.numel)))
    with trace_range("shardkit::pack_grads"):
        torch._chunk_cat(chunks, dim=0, num_chunks=group_size, out=inp)
    if pre_divide != 1.0:
        inp.div_(pre_divide)
    return inp


def grad_as_input(p: ShardedParam, grad: torch.Tensor | None, dtype: torch.dtype,
                  group_size: int, pre_divide: float) -> torch.Tensor | None:
    """A direct bucket's grad viewed as its own (group_size, shard) reduce input, or None where it
    cannot be (absent, another dtype, padded, not contiguous): then it is packed like the rest."""
    if (grad is None or grad.dtype != dtype or p.numel != p.padded_numel
            or not grad.is_contiguous()):
        return None
    inp = grad.view(group_size, p.shard_numel)
    if pre_divide != 1.0:
        inp.div_(pre_divide)
    return inp


def start_reduce_scatter(params: Sequence[ShardedParam], inp: torch.Tensor, device: torch.device,
                         group: Group, backend: Backend, stats: CommStats | None,
                         plan: "ReducePlan", stream: Any = None,
                         pooled: bool = True) -> PendingReduce:
    """Start the reduce-scatter (the plan's op) of a packed input; this rank's row lands in the output."""
    # Packing ran on the compute stream (where the grads were made); the collective runs on the
    # reduce stream so the next unit's backward can proceed.
    stream = stream if stream is not None else backend.current_stream(device)
    stream.wait_stream(backend.current_stream(device))
    backend.record_stream(inp, stream)
    with backend.use_stream(stream):
        out = torch.empty(inp.shape[1], dtype=inp.dtype, device=device)
        if stats is not None:
            stats.reduce_scatter(out.numel() * out.element_size(), group.size,
                                 stats.crosses_node(group))
        with trace_range("shardkit::reduce_scatter"):
            work = backend.reduce_scatter_tensor(out, inp.view(-1), group, op=plan.scatter_op,
                                                 async_op=True,
                                                 **factor_kwargs(plan.scatter_factor))
        event = backend.new_event()
        event.record(stream)
    return PendingReduce(list(params), work, out, inp, plan, event, pooled, group)


def reduced_row(pending: PendingReduce, replica: Group | None, backend: Backend,
                stats: CommStats | None) -> torch.Tensor:
    """Wait for the reduce-scatter, reduce across replicas and divide (SUM plans): this rank's
    averaged row of the bucket, in the reduce dtype on the compute device."""
    device = pending.output.device
    current = backend.current_stream(device)
    # The compute stream first waits for all the reduce stream queued (the collective's launch
    # included), then for the collective: a backend whose wait() ends with a copy on the current
    # stream (the cpu backend's reduce-scatter, built from an all-reduce, under "cuda+gloo") then
    # reads a result the compute stream is already ordered after. torch's CUDA sanitizer, which
    # counts a c10d op as a kernel of the stream that issued it, reported the other order.
    if pending.event is not None:
        current.wait_event(pending.event)
    pending.work.wait()
    out = pending.output
    backend.record_stream(out, current)
    if replica is not None and replica.size > 1:
        if stats is not None:
            stats.all_reduce(out.numel() * out.element_size(), replica.size,
                             stats.crosses_node(replica))
        backend.all_reduce(out, replica, op=pending.plan.replica_op, async_op=False,
                           **factor_kwargs(pending.plan.replica_factor)).wait()
    if pending.plan.post_divide != 1.0:
        out.div_(pending.plan.post_divide)
    share_replicated_scalars(pending.params, out, pending.group, backend, stats)
    return out


def share_replicated_scalars(params: Sequence[ShardedParam], row: torch.Tensor,
                             group: Group | None, backend: Backend, stats: CommStats | None) -> None:
    """Give every rank of the shard group the reduced gradient of each replicated 0-d parameter.

    The reduce-scatter leaves such a gradient on shard rank 0 (the others' slots are zero), but
    every rank holds and steps the parameter (sharding/step/whole_view.py). One small sum over the
    group, to which the other ranks add exact zeros, hands out rank 0's value bit for bit, so the
    replicas stay identical (summing the gradient into every rank's slot instead would round
    differently per slot at 3+ ranks).
    """
    if group is None or group.size <= 1 or not any(p.replicated_scalar for p in params):
        return  # the per-step case: no 0-d parameter in this bucket
    where, offset = [], 0
    for p, size in zip(params, row_sizes(params)):
        if p.replicated_scalar:
            where.append(offset)
        offset += size
    index = torch.tensor(where, device=row.device)
    values = row.index_select(0, index)
    if stats is not None:
        stats.all_reduce(values.numel() * values.element_size(), group.size,
                         stats.crosses_node(group))
    backend.all_reduce(values, group, op="sum", async_op=False).wait()
    row.index_copy_(0, index, values)


def finish_reduce(pending: PendingReduce, replica: Group | None, backend: Backend,
                  stats: CommStats | None, pool: BufferPool | None = None) -> None:
    """Complete a bucket's reduction (reduced_row) and add it into the sharded grads."""
    out = reduced_row(pending, replica, backend, stats)
    if pool is not None and pending.pooled:
        pool.give(pending.input)
    params = pending.params
    # Cast (and move, with cpu_offload) the whole row once, then hand out views of it.
    masters = {(p.local.dtype, p.local.device) for p in params}
    if len(masters) == 1:
        dtype, dev = masters.pop()
        out = out.to(device=dev, dtype=dtype)
    for p, grad in zip(params, torch.split(out, row_sizes(params))):
        p.accumulate_grad(grad)
