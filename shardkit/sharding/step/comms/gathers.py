"""All-gather strategies (the built-in, int8 blocks, a user's comm) and the template around them:
copy-in on the gather stream, the collective, the event the compute stream waits on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from typing_extensions import override

from ....backend import Backend
from ....handles import Group, TorchWork, Work
from ..buffers import BufferPool
from ..collectives import copy_in, copy_out, row_sizes
from ..param import ShardedParam
from ..quantize import decode_rows, encode_rows, payload_bytes
from ..trace import trace_range
from ..traffic import CommStats

# Run once the compute stream may read a collective's result: given that stream, it completes
# the result in place (a quantized payload decoded into the output).
Finish = Callable[[Any], None]

NO_POOL = BufferPool(enabled=False, max_buffers=0)


class GatherComm:
    """The backend's all-gather: every rank's row of a flat buffer, filled from each rank's own row."""

    def __init__(self, backend: Backend, stats: CommStats | None) -> None:
        self.backend = backend
        self.stats = stats

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device,
                 pool: BufferPool) -> tuple[torch.Tensor, bool]:
        """The output buffer of `numel` elements, and whether it came from (and goes back to) `pool`."""
        return pool.take(numel, dtype, device), pool.enabled

    def launch(self, output: torch.Tensor, row: torch.Tensor, group: Group,
               async_op: bool) -> tuple[Work, Finish | None]:
        """Start the all-gather of `row` (this rank's slice of `output`) over `group`."""
        if self.stats is not None:
            self.stats.all_gather(row.numel() * row.element_size(), group.size,
                                  self.stats.crosses_node(group))
        with trace_range("shardkit::all_gather"):
            return self.call(output, row, group, async_op), None

    def call(self, output: torch.Tensor, row: torch.Tensor, group: Group, async_op: bool) -> Work:
        """The collective itself: the backend's all-gather."""
        return self.backend.collectives.all_gather_into_tensor(output, row, group, async_op=async_op)


class QuantizedGather(GatherComm):
    """Each rank's row travels as int8 blocks (Quantization.weights); the wait decodes every row,
    this rank's own included, so all ranks compute with the same values."""

    def __init__(self, backend: Backend, stats: CommStats | None, block: int) -> None:
        super().__init__(backend, stats)
        self.block = block

    @override
    def launch(self, output: torch.Tensor, row: torch.Tensor, group: Group,
               async_op: bool) -> tuple[Work, Finish | None]:
        """Encode `row`, start the all-gather of the payloads; the finish decodes into `output`."""
        if group.size <= 1:
            return super().launch(output, row, group, async_op)
        numel, block = row.numel(), self.block
        payload = torch.empty(group.size, payload_bytes(numel, block), dtype=torch.uint8,
                              device=row.device)
        with trace_range("shardkit::quantize"):
            encode_rows(row.view(1, numel), block, out=payload[group.rank])
        if self.stats is not None:
            self.stats.all_gather(payload.shape[1], group.size, self.stats.crosses_node(group))
        with trace_range("shardkit::all_gather"):
            work = self.backend.collectives.all_gather_into_tensor(payload.view(-1), payload[group.rank],
                                                       group, async_op=async_op)
        decoded = False

        def finish(current: Any) -> None:
            nonlocal decoded
            if decoded:  # a second wait() must not overwrite what the first decoded
                return
            self.backend.devices.record_stream(payload, current)
            with trace_range("shardkit::dequantize"):
                output.view(group.size, -1).copy_(decode_rows(payload, numel, block))
            decoded = True

        return work, finish


class CustomGather(GatherComm):
    """A user's all-gather (model.set_custom_all_gather): FSDP2's AllGather interface, called where
    the built-in one would be, with the same buffers; a one-rank group copies locally."""

    def __init__(self, backend: Backend, stats: CommStats | None, comm: Any) -> None:
        super().__init__(backend, stats)
        self.comm = comm

    @override
    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device,
                 pool: BufferPool) -> tuple[torch.Tensor, bool]:
        """The comm's own buffer (its allocate()), never pooled."""
        return self.comm.allocate((numel,), dtype=dtype, device=device), False

    @override
    def call(self, output: torch.Tensor, row: torch.Tensor, group: Group, async_op: bool) -> Work:
        """The user's comm, given torch's process group (the bytes are counted as the built-in's)."""
        if group.size <= 1:
            return super().call(output, row, group, async_op)
        return TorchWork(self.comm(output_tensor=output, input_tensor=row, group=group.handle,
                                   async_op=async_op))


@dataclass
class PendingGather:
    """An all-gather in flight: wait on it, then copy `output` out (or use it in place)."""

    work: Work
    output: torch.Tensor
    event: Any = None  # recorded on the gather stream after the collective was queued
    into_storage: bool = False  # `output` is a direct bucket's own param storage: no copy-out
    pooled: bool = False  # `output` goes back to the model's buffer pool once copied out
    finish: Finish | None = None  # completes `output` after the wait (a quantized decode)

    def wait(self, backend: Backend, device: torch.device) -> None:
        """Make the compute stream see the gathered data (blocks the host where there are no streams)."""
        current = backend.devices.current_stream(device)
        if self.event is not None:  # before the work's wait: see UnitCollectives.reduced_row
            current.wait_event(self.event)
        self.work.wait()
        # The output was allocated on the gather stream; copy-out reads it on the compute stream.
        backend.devices.record_stream(self.output, current)
        if self.finish is not None:
            self.finish(current)


def start_gather(comm: GatherComm, params: Sequence[ShardedParam], dtype: torch.dtype,
                 group: Group, device: torch.device, async_op: bool, stream: Any = None,
                 pool: BufferPool | None = None, source: torch.Tensor | None = None,
                 into: torch.Tensor | None = None) -> PendingGather:
    """Copy this rank's shards (cast to `dtype`) into its row of one flat output and start `comm`.

    With a separate gather `stream`, copy-in and the collective run there so they overlap with
    compute; the stream first waits for the compute stream (the optimizer may just have written
    the shards). `source`, when given, is this rank's ready-made row instead of the shards (the
    slice kept by reshard_after_forward=k, gathered over the k-rank `group`). `into`, when given,
    is the output (a direct bucket's padded flat storage) instead of the comm's buffer.
    """
    backend = comm.backend
    stream = stream if stream is not None else backend.devices.current_stream(device)
    stream.wait_stream(backend.devices.current_stream(device))
    if source is not None:
        backend.devices.record_stream(source, stream)  # the caller drops it while the copy is queued
    with backend.devices.use_stream(stream):
        row = sum(row_sizes(params)) if source is None else source.numel()
        if into is not None:
            out, pooled = into, False
        else:
            out, pooled = comm.allocate(group.size * row, dtype, device, pool or NO_POOL)
        # Copy-in straight into this rank's row of the output (an in-place all-gather): no
        # separate input buffer, one copy fewer.
        mine = out[group.rank * row:(group.rank + 1) * row]
        with trace_range("shardkit::copy_in"):
            if source is None:
                copy_in(params, mine, row_sizes(params))
            else:
                mine.copy_(source)
        work, finish = comm.launch(out, mine, group, async_op)
        event = backend.devices.new_event()
        event.record(stream)
    return PendingGather(work, out, event, into_storage=into is not None, pooled=pooled,
                         finish=finish)


def gather_full(comm: GatherComm, params: Sequence[ShardedParam], dtype: torch.dtype,
                group: Group, device: torch.device) -> list[torch.Tensor]:
    """Return fresh full tensors (original shapes, `dtype`) of `params` through `comm`; synchronous."""
    pending = start_gather(comm, params, dtype, group, device, async_op=False)
    pending.wait(comm.backend, device)  # fresh buffers (no pool): the caller may keep views
    flats = [torch.empty(p.padded_numel, dtype=dtype, device=device) for p in params]
    copy_out(params, pending.output, flats, group.size)
    # A padded buffer would drag its tail into whatever keeps the tensor (a saved file).
    return [f.view(p.full_shape) if p.numel == p.padded_numel
            else f[:p.numel].clone().view(p.full_shape) for p, f in zip(params, flats)]


def gather_exact(params: Sequence[ShardedParam], dtype: torch.dtype, group: Group,
                 backend: Backend, device: torch.device,
                 stats: CommStats | None) -> list[torch.Tensor]:
    """gather_full with the backend's own all-gather: what saving and state_dict() read (exact
    values, whatever the model trains with)."""
    return gather_full(GatherComm(backend, stats), params, dtype, group, device)
