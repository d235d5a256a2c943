"""Reduce-scatter strategies (the built-in, int8 blocks in one or two hops, a user's comm) and
the all-reduce across replicas (exact, int8 blocks): the parts of a gradient reduction that vary."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from typing_extensions import override

from ....backend import Backend
from ....handles import CompletedWork, Group, ReduceOp, TorchWork, Work
from ..buffers import BufferPool
from ..collectives import factor_kwargs
from ..param import ShardedParam
from ..quantize import decode_rows, encode_rows, payload_bytes
from ..reduce_ops import ReducePlan
from ..trace import trace_range
from ..traffic import CommStats
from .gathers import Finish


class CrossGroupReduce(Protocol):
    """The mean across replica groups that are not part of this job (fault tolerance)."""

    def all_reduce_mean(self, tensor: torch.Tensor) -> int:
        """Average `tensor` in place over the groups taking part; return their number."""


def apply_op(total: torch.Tensor, op: str, factor: float | None, size: int) -> torch.Tensor:
    """What the collective's `op` would have made of a sum over `size` ranks (fp32, in place)."""
    if op == ReduceOp.AVG:
        return total.div_(size)
    if op == ReduceOp.PREMUL_SUM and factor is not None:
        return total.mul_(factor)
    return total


class ScatterComm:
    """The backend's reduce-scatter: row r of every rank's (group size, row) input summed into rank r."""

    def __init__(self, backend: Backend, stats: CommStats | None) -> None:
        self.backend = backend
        self.stats = stats

    def exact_ops(self, dtype: torch.dtype) -> frozenset[str]:
        """The averaging ops (AVG, PREMUL_SUM) this reduce-scatter computes exactly for `dtype`."""
        return self.backend.collectives.exact_reduce_ops_for(dtype)

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device,
                 pool: BufferPool) -> tuple[torch.Tensor, bool]:
        """A buffer (input or output) of `numel` elements, and whether it came from `pool`."""
        return pool.take(numel, dtype, device), pool.enabled

    def output(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The reduced row's buffer (its own: it becomes the sharded gradients)."""
        return torch.empty(numel, dtype=dtype, device=device)

    def launch(self, output: torch.Tensor, rows: torch.Tensor, group: Group,
               plan: ReducePlan) -> tuple[Work, Finish | None]:
        """Start the reduction of `rows` (group size, row) into `output` with the plan's op."""
        if self.stats is not None:
            self.stats.reduce_scatter(output.numel() * output.element_size(), group.size,
                                      self.stats.crosses_node(group))
        with trace_range("shardkit::reduce_scatter"):
            return self.call(output, rows.view(-1), group, plan), None

    def call(self, output: torch.Tensor, flat: torch.Tensor, group: Group,
             plan: ReducePlan) -> Work:
        """The collective itself: the backend's reduce-scatter with the plan's op, async."""
        return self.backend.collectives.reduce_scatter_tensor(output, flat, group, op=plan.scatter_op,
                                                  async_op=True,
                                                  **factor_kwargs(plan.scatter_factor))


class QuantizedScatter(ScatterComm):
    """Each rank's (group size, row) input travels as int8 blocks through an all-to-all, and the
    rows this rank received are summed in fp32 (Quantization.gradients, ZeRO++ qgZ). With
    `node_hops` (this rank's node group and its group across nodes, for a shard group spanning
    nodes) in two hops: inside the node first, then across nodes with one row per peer node."""

    def __init__(self, backend: Backend, stats: CommStats | None, block: int,
                 node_hops: tuple[Group, Group] | None = None) -> None:
        super().__init__(backend, stats)
        self.block = block
        self.node_hops = node_hops

    @override
    def launch(self, output: torch.Tensor, rows: torch.Tensor, group: Group,
               plan: ReducePlan) -> tuple[Work, Finish | None]:
        """Start the quantized all-to-all; the finish decodes, sums and applies the plan's op."""
        if group.size <= 1:
            return super().launch(output, rows, group, plan)
        if self.node_hops is not None:
            rows = self._node_sums(rows, self.node_hops[0])
        work, received = self.start_all_to_all(rows, group if self.node_hops is None
                                                else self.node_hops[1])
        decoded = False

        def finish(current: Any) -> None:
            nonlocal decoded
            if decoded:
                return
            self.backend.devices.record_stream(received, current)
            with trace_range("shardkit::dequantize"):
                total = decode_rows(received, output.numel(), self.block).sum(dim=0)
                output.copy_(apply_op(total, plan.scatter_op, plan.scatter_factor, group.size))
            decoded = True

        return work, finish

    def start_all_to_all(self, rows: torch.Tensor, group: Group, per_peer: int = 1,
                         kind: str = "reduce_scatter") -> tuple[Work, torch.Tensor]:
        """Encode each row as int8 blocks and start the all-to-all, `per_peer` consecutive rows to
        each group rank; return it and the received payload (rank r's rows for this rank, in order)."""
        with trace_range("shardkit::quantize"):
            sent = encode_rows(rows, self.block)
        received = torch.empty_like(sent)
        if self.stats is not None:
            self.stats.all_to_all(kind, sent.shape[1] * per_peer, group.size,
                                  self.stats.peers_elsewhere(group))
        with trace_range("shardkit::reduce_scatter"):
            work = self.backend.collectives.all_to_all_single(received.view(-1), sent.view(-1), group,
                                                  async_op=True)
        # The send buffer must outlive the collective, and not every backend's work references it.
        return KeepAlive(work, sent), received

    def _node_sums(self, rows: torch.Tensor, node: Group) -> torch.Tensor:
        """Hop one of a two-hop quantized reduce-scatter: sum inside the node, in fp32.

        Rows are rank-major over a shard group of nodes x node.size consecutive ranks; node peer
        j receives the rows of every rank at position j of its node, so afterwards this rank
        holds its node's sums of the (nodes, row) rows that the ranks at its own position own.
        """
        width = node.size
        nodes = rows.shape[0] // width
        by_peer = rows.view(nodes, width, -1).transpose(0, 1).reshape(nodes * width, -1)
        pending, received = self.start_all_to_all(by_peer, node, per_peer=nodes)
        pending.wait()
        return decode_rows(received, rows.shape[1], self.block).view(width, nodes, -1).sum(dim=0)


class CustomScatter(ScatterComm):
    """A user's reduce-scatter (model.set_custom_reduce_scatter): FSDP2's ReduceScatter interface,
    called with op SUM (the engine divides around it) where the built-in one would be, with the
    same bytes; a one-rank group copies locally."""

    def __init__(self, backend: Backend, stats: CommStats | None, comm: Any) -> None:
        super().__init__(backend, stats)
        self.comm = comm

    @override
    def exact_ops(self, dtype: torch.dtype) -> frozenset[str]:
        """None: a user's comm is only promised to sum."""
        return frozenset()

    @override
    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device,
                 pool: BufferPool) -> tuple[torch.Tensor, bool]:
        """The comm's own buffer (its allocate()), never pooled."""
        return self.comm.allocate((numel,), dtype=dtype, device=device), False

    @override
    def output(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The reduced row's buffer, from the comm's allocate()."""
        return self.comm.allocate((numel,), dtype=dtype, device=device)

    @override
    def call(self, output: torch.Tensor, flat: torch.Tensor, group: Group,
             plan: ReducePlan) -> Work:
        """The user's comm, given torch's process group and SUM, asked async (the plan of a
        custom scatter is SUM: exact_ops)."""
        if group.size <= 1:
            return super().call(output, flat, group, plan)
        return TorchWork(self.comm(output_tensor=output, input_tensor=flat, group=group.handle,
                                   op=self.backend.collectives.torch_reduce_op(ReduceOp.SUM), async_op=True))


@dataclass
class KeepAlive:
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


# ---- the all-reduce across replicas ----------------------------------------------------------
class ReplicaReduce:
    """The backend's all-reduce of a reduced row across the replicas of its shard (HYBRID, NO_SHARD)."""

    def __init__(self, backend: Backend, stats: CommStats | None) -> None:
        self.backend = backend
        self.stats = stats

    def all_reduce(self, row: torch.Tensor, group: Group, op: str, factor: float | None) -> None:
        """Reduce `row` in place over `group` with `op` (synchronous)."""
        if self.stats is not None:
            self.stats.all_reduce(row.numel() * row.element_size(), group.size,
                                  self.stats.crosses_node(group))
        self.backend.collectives.all_reduce(row, group, op=op, async_op=False, **factor_kwargs(factor)).wait()


class QuantizedReplicaReduce(ReplicaReduce):
    """The all-reduce moving int8 blocks both ways (qgZ's inter-node hop).

    Each rank receives every rank's quantized slice of its 1/N of the tensor (all-to-all), sums
    them in fp32, and the sums are all-gathered quantized once more; every rank decodes the same
    gathered bytes, so replicas stay identical.
    """

    def __init__(self, backend: Backend, stats: CommStats | None, block: int) -> None:
        super().__init__(backend, stats)
        self.scatter = QuantizedScatter(backend, stats, block)
        self.block = block

    @override
    def all_reduce(self, row: torch.Tensor, group: Group, op: str, factor: float | None) -> None:
        """All-reduce the flat `row` in place through two quantized hops."""
        size, numel, block = group.size, row.numel(), self.block
        width = -(-numel // size)
        rows = torch.nn.functional.pad(row.reshape(-1).float(), (0, size * width - numel))
        pending, received = self.scatter.start_all_to_all(rows.view(size, width), group,
                                                          kind="all_reduce")
        pending.wait()
        mine = apply_op(decode_rows(received, width, block).sum(dim=0), op, factor, size)
        gathered = torch.empty(size, payload_bytes(width, block), dtype=torch.uint8,
                               device=row.device)
        encode_rows(mine.view(1, width), block, out=gathered[group.rank])
        if self.stats is not None:
            self.stats.all_gather(gathered.shape[1], size, self.stats.crosses_node(group),
                                  kind="all_reduce")
        self.backend.collectives.all_gather_into_tensor(gathered.view(-1), gathered[group.rank], group).wait()
        row.view(-1).copy_(decode_rows(gathered, width, block).reshape(-1)[:numel])


@dataclass
class PendingReduce:
    """A reduce-scatter in flight for one unit bucket."""

    params: list[ShardedParam]
    work: Work
    output: torch.Tensor
    input: torch.Tensor  # kept alive until the collective finished reading it
    plan: ReducePlan
    group: Group  # the shard group it reduced over
    event: Any = None  # recorded on the reduce stream after the collective was queued
    pooled: bool = True  # `input` came from the buffer pool (not a direct bucket's own grad)
    finish: Finish | None = None  # completes `output` after the wait (a quantized decode)
