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
from ...handles import CompletedWork, Group, ReduceOp, Work
from .buffers import BufferPool
from .traffic import CommStats
from .param import ShardedParam
from .quantize import decode_rows, encode_rows, payload_bytes
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
    payload: torch.Tensor | None = None  # int8 blocks gathered (Quantization.weights): decoded
    block: int = 0  # ... into `output` by wait()

    def wait(self, backend: Backend, device: torch.device) -> None:
        """Make the compute stream see the gathered data (blocks the host where there are no streams)."""
        current = backend.current_stream(device)
        if self.event is not None:  # before the work's wait: see reduced_row
            current.wait_event(self.event)
        self.work.wait()
        # The output was allocated on the gather stream; copy-out reads it on the compute stream.
        backend.record_stream(self.output, current)
        if self.payload is not None:
            backend.record_stream(self.payload, current)
            rows = self.output.view(self.payload.shape[0], -1)
            with trace_range("shardkit::dequantize"):
                rows.copy_(decode_rows(self.payload, rows.shape[1], self.block))
            self.payload = None  # decoded once: a second wait() must not overwrite


def start_all_gather(params: Sequence[ShardedParam], dtype: torch.dtype, device: torch.device,
                     group: Group, backend: Backend, stats: CommStats | None,
                     async_op: bool, stream: Any = None,
                     pool: BufferPool | None = None,
                     source: torch.Tensor | None = None,
                     into: torch.Tensor | None = None,
                     quantize_block: int = 0) -> PendingGather:
    """Copy this rank's shards (cast to `dtype`) into one flat input and start the all-gather.

    With a separate gather `stream`, copy-in and the collective run there so they overlap with
    compute; the stream first waits for the compute stream (the optimizer may just have written
    the shards). `source`, when given, is this rank's ready-made row instead of the shards (the
    slice kept by reshard_after_forward=k, gathered over the k-rank `group`). `into`, when given,
    is the output (a direct bucket's padded flat storage) instead of a pooled buffer.
    `quantize_block` > 0 gathers int8 blocks of that size instead (Quantization.weights); wait()
    decodes them into the output, this rank's row included.
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
        payload = None
        if quantize_block and group.size > 1:
            payload = torch.empty(group.size, payload_bytes(row, quantize_block),
                                  dtype=torch.uint8, device=device)
            with trace_range("shardkit::quantize"):
                encode_rows(inp.view(1, row), quantize_block, out=payload[group.rank])
            sent, gathered = payload[group.rank], payload.view(-1)
        else:
            sent, gathered = inp, out
        if stats is not None:
            stats.all_gather(sent.numel() * sent.element_size(), group.size,
                             stats.crosses_node(group))
        with trace_range("shardkit::all_gather"):
            work = backend.all_gather_into_tensor(gathered, sent, group, async_op=async_op)
        event = backend.new_event()
        event.record(stream)
    return PendingGather(work, out, inp, event, into_storage=into is not None, payload=payload,
                         block=quantize_block)


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
                group: Group, backend: Backend, stats: CommStats | None,
                quantize_block: int = 0) -> list[torch.Tensor]:
    """Return fresh full tensors (original shapes, `dtype`) of `params`; synchronous."""
    pending = start_all_gather(params, dtype, device, group, backend, stats, async_op=False,
                               quantize_block=quantize_block)
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
    block: int = 0  # > 0: every hop of this reduction moves int8 blocks (Quantization.gradients)
    payload: torch.Tensor | None = None  # received int8 rows, summed into `output` by reduced_row


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
                         pooled: bool = True, quantize_block: int = 0,
                         node_hops: tuple[Group, Group] | None = None) -> PendingReduce:
    """Start the reduce-scatter (the plan's op) of a packed input; this rank's row lands in the output.

    `quantize_block` > 0: each rank's (group_size, row) input travels as int8 blocks through an
    all-to-all instead, and reduced_row sums the rows this rank received in fp32. With
    `node_hops` (this rank's node group and its group across nodes, for a shard group spanning
    nodes) in two hops: inside the node first, then across nodes with one row per peer node.
    """
    # Packing ran on the compute stream (where the grads were made); the collective runs on the
    # reduce stream so the next unit's backward can proceed.
    stream = stream if stream is not None else backend.current_stream(device)
    stream.wait_stream(backend.current_stream(device))
    backend.record_stream(inp, stream)
    with backend.use_stream(stream):
        out = torch.empty(inp.shape[1], dtype=inp.dtype, device=device)
        if quantize_block and group.size > 1:
            rows = inp if node_hops is None else _node_sums(inp, node_hops[0], backend, stats,
                                                           quantize_block)
            work, payload = _start_quantized_scatter(rows, group if node_hops is None
                                                     else node_hops[1], backend, stats,
                                                     quantize_block)
        else:
            payload = None
            if stats is not None:
                stats.reduce_scatter(out.numel() * out.element_size(), group.size,
                                     stats.crosses_node(group))
            with trace_range("shardkit::reduce_scatter"):
                work = backend.reduce_scatter_tensor(out, inp.view(-1), group, op=plan.scatter_op,
                                                     async_op=True,
                                                     **factor_kwargs(plan.scatter_factor))
        event = backend.new_event()
        event.record(stream)
    return PendingReduce(list(params), work, out, inp, plan, event, pooled, group,
                         quantize_block, payload)


def _start_quantized_scatter(rows: torch.Tensor, group: Group, backend: Backend,
                             stats: CommStats | None, block: int,
                             per_peer: int = 1,
                             kind: str = "reduce_scatter") -> tuple[Work, torch.Tensor]:
    """Encode each row as int8 blocks and start the all-to-all, `per_peer` consecutive rows to
    each group rank; return it and the received payload (rank r's rows for this rank, in order)."""
    with trace_range("shardkit::quantize"):
        sent = encode_rows(rows, block)
    received = torch.empty_like(sent)
    if stats is not None:
        stats.all_to_all(kind, sent.shape[1] * per_peer, group.size,
                         stats.peers_elsewhere(group))
    with trace_range("shardkit::reduce_scatter"):
        work = backend.all_to_all_single(received.view(-1), sent.view(-1), group, async_op=True)
    # The send buffer must outlive the collective, and not every backend's work references it.
    return _KeepAlive(work, sent), received


def _node_sums(rows: torch.Tensor, node: Group, backend: Backend, stats: CommStats | None,
               block: int) -> torch.Tensor:
    """Hop one of a two-hop quantized reduce-scatter: sum inside the node, in fp32.

    Rows are rank-major over a shard group of nodes x node.size consecutive ranks; node peer j
    receives the rows of every rank at position j of its node, so afterwards this rank holds
    its node's sums of the (nodes, row) rows that the ranks at its own position own.
    """
    width = node.size
    nodes = rows.shape[0] // width
    by_peer = rows.view(nodes, width, -1).transpose(0, 1).reshape(nodes * width, -1)
    pending, received = _start_quantized_scatter(by_peer, node, backend, stats, block,
                                                 per_peer=nodes)
    pending.wait()
    return decode_rows(received, rows.shape[1], block).view(width, nodes, -1).sum(dim=0)


@dataclass
class _KeepAlive:
    """A Work that holds its send buffer until waited on."""

    work: Work
    sent: torch.Tensor | None

    def wait(self) -> None:
        """Wait for the collective, then let go of the send buffer and of the library's handle
        (which may reference both buffers for as long as it lives)."""
        self.work.wait()
        self.work, self.sent = CompletedWork(), None

    def is_completed(self) -> bool:
        """Whether the collective finished."""
        return self.work.is_completed()


def _apply_op(total: torch.Tensor, op: str, factor: float | None, size: int) -> torch.Tensor:
    """What the collective's `op` would have made of a sum over `size` ranks (fp32, in place)."""
    if op == ReduceOp.AVG:
        return total.div_(size)
    if op == ReduceOp.PREMUL_SUM and factor is not None:
        return total.mul_(factor)
    return total


def quantized_all_reduce(tensor: torch.Tensor, group: Group, backend: Backend,
                         stats: CommStats | None, block: int, op: str,
                         factor: float | None) -> None:
    """All-reduce a flat `tensor` in place, moving int8 blocks both ways (qgZ's inter-node hop).

    Each rank receives every rank's quantized slice of its 1/N of the tensor (all-to-all), sums
    them in fp32, and the sums are all-gathered quantized once more; every rank decodes the same
    gathered bytes, so replicas stay identical.
    """
    size, numel = group.size, tensor.numel()
    width = -(-numel // size)
    rows = torch.nn.functional.pad(tensor.reshape(-1).float(), (0, size * width - numel))
    pending, received = _start_quantized_scatter(rows.view(size, width), group, backend, stats,
                                                 block, kind="all_reduce")
    pending.wait()
    mine = _apply_op(decode_rows(received, width, block).sum(dim=0), op, factor, size)
    gathered = torch.empty(size, payload_bytes(width, block), dtype=torch.uint8,
                           device=tensor.device)
    encode_rows(mine.view(1, width), block, out=gathered[group.rank])
    if stats is not None:
        stats.all_gather(gathered.shape[1], size, stats.crosses_node(group), kind="all_reduce")
    backend.all_gather_into_tensor(gathered.view(-1), gathered[group.rank], group).wait()
    tensor.view(-1).copy_(decode_rows(gathered, width, block).reshape(-1)[:numel])


def reduced_row(pending: PendingReduce, replica: Group | None, backend: Backend,
                stats: CommStats | None, cross_groups: Any = None) -> torch.Tensor:
    """Wait for the reduce-scatter, reduce across replicas and divide (SUM plans): this rank's
    averaged row of the bucket, in the reduce dtype on the compute device. `cross_groups`
    (fault tolerance) then averages the row over the replica groups outside this job."""
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
    plan = pending.plan
    if pending.payload is not None:
        backend.record_stream(pending.payload, current)
        with trace_range("shardkit::dequantize"):
            total = decode_rows(pending.payload, out.numel(), pending.block).sum(dim=0)
            summed_over = pending.group.size if pending.group is not None else 1
            out.copy_(_apply_op(total, plan.scatter_op, plan.scatter_factor, summed_over))
        pending.payload = None
    if replica is not None and replica.size > 1:
        if pending.block:
            quantized_all_reduce(out, replica, backend, stats, pending.block, plan.replica_op,
                                 plan.replica_factor)
        else:
            if stats is not None:
                stats.all_reduce(out.numel() * out.element_size(), replica.size,
                                 stats.crosses_node(replica))
            backend.all_reduce(out, replica, op=plan.replica_op, async_op=False,
                               **factor_kwargs(plan.replica_factor)).wait()
    if pending.plan.post_divide != 1.0:
        out.div_(pending.plan.post_divide)
    if cross_groups is not None:
        # After the divide: the row is this group's mean, and the mean of equal-size groups'
        # means is the mean over every sample that took part.
        with trace_range("shardkit::cross_group_all_reduce"):
            groups = cross_groups.all_reduce_mean(out)
        if stats is not None:
            stats.all_reduce(out.numel() * out.element_size(), groups, crosses_node=True)
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
                  stats: CommStats | None, pool: BufferPool | None = None,
                  cross_groups: Any = None) -> None:
    """Complete a bucket's reduction (reduced_row) and add it into the sharded grads."""
    out = reduced_row(pending, replica, backend, stats, cross_groups)
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
