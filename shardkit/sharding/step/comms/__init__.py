"""Collective strategies: how one unit's all-gathers and gradient reductions move their bytes.

Chosen once per unit at shard() (`choose`), from the model's settings, and swapped only by the
public hooks (model.set_custom_all_gather / set_custom_reduce_scatter):

- gathers: `GatherComm` (the backend's all-gather), `QuantizedGather` (int8 blocks,
  Quantization.weights), `CustomGather` (a user's comm);
- reduce-scatters: `ScatterComm` (the backend's), `QuantizedScatter` (an all-to-all of int8 blocks
  summed in fp32; in two hops when the shard group spans nodes), `CustomScatter` (a user's comm);
- the all-reduce across replicas (HYBRID_SHARD, NO_SHARD): `ReplicaReduce`, `QuantizedReplicaReduce`;
- then, under fault tolerance, the mean across replica groups (fault_tolerance/cross_groups.py).

A strategy owns its buffers, counts the bytes it sends and says how its result is finished after
the wait (a quantized one decodes). What every collective needs around it (streams, events,
copy-in, the replica and cross-group steps, the divide) is written once, in `UnitCollectives`, so
unit.py and traced.py call `start_gather` / `start_reduce` / `reduced_row` and never ask which
strategy they hold. Each strategy also says which exact averaging ops its reduce-scatter accepts
(`exact_ops`): a user's comm is only promised SUM, and the engine divides around it.

gathers.py holds the all-gather strategies and their template (start_gather, gather_full);
reductions.py the reduce-scatter and replica strategies; this module a unit's set of them
(UnitCollectives: the reduction's template, the reduce plans) and `choose`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch

from ....backend import Backend
from ....errors import ShardkitError
from ....handles import Group
from ..buffers import BufferPool
from ..collectives import grad_as_input, pack_grads, row_sizes, share_replicated_scalars
from ..param import ShardedParam
from ..reduce_ops import ReducePlan, reduce_plan
from ..trace import trace_range
from ..traffic import CommStats
from .gathers import (NO_POOL, CustomGather, GatherComm, PendingGather, QuantizedGather, gather_exact,
                      gather_full, start_gather)
from .reductions import (CrossGroupReduce, CustomScatter, PendingReduce, QuantizedReplicaReduce,
                         QuantizedScatter, ReplicaReduce, ScatterComm)

__all__ = ["CrossGroupReduce", "CustomGather", "CustomScatter", "GatherComm", "PendingGather",
           "PendingReduce", "QuantizedGather", "QuantizedReplicaReduce", "QuantizedScatter",
           "ReplicaReduce", "ScatterComm", "UnitCollectives", "check_custom_comm", "choose",
           "gather_exact"]


class CommRuntime(Protocol):
    """What a unit's collectives read from the model's runtime state (state.ShardState)."""

    backend: Backend
    device: torch.device
    shard_group: Group
    replica_group: Group | None
    cross_groups: Any
    pool: BufferPool
    stats: CommStats
    gather_stream: Any
    reduce_stream: Any


@dataclass
class UnitCollectives:
    """One unit's strategies and the template they run in: what unit.py and traced.py call."""

    rt: CommRuntime
    gather: GatherComm  # over the shard group
    regather: GatherComm  # over the k-rank group of reshard_after_forward=k (exact values already)
    scatter: ScatterComm
    replica: ReplicaReduce
    plans: dict[torch.dtype, ReducePlan] = field(default_factory=dict)  # per reduce dtype

    def plan(self, dtype: torch.dtype) -> ReducePlan:
        """How a `dtype` bucket is averaged: the scatter's exact ops, else SUM + divide (fixed for the
        model's life, decided on first use: a backend may consult its library version)."""
        plan = self.plans.get(dtype)
        if plan is None:
            rt = self.rt
            replicas = rt.replica_group.size if rt.replica_group is not None else 1
            plan = self.plans[dtype] = reduce_plan(self.scatter.exact_ops(dtype), dtype,
                                                   rt.shard_group.size, replicas)
        return plan

    def start_gather(self, params: Sequence[ShardedParam], dtype: torch.dtype, group: Group,
                     async_op: bool, source: torch.Tensor | None = None,
                     into: torch.Tensor | None = None) -> PendingGather:
        """Start one bucket's all-gather on the gather stream (from a kept 1/k `source`: regather)."""
        rt = self.rt
        comm = self.gather if source is None else self.regather
        return start_gather(comm, params, dtype, group, rt.device, async_op, rt.gather_stream,
                            rt.pool, source, into)

    def release(self, pending: PendingGather) -> None:
        """Hand a waited-on gather's buffer back (to the pool where it came from there)."""
        if pending.pooled:
            self.rt.pool.give(pending.output)

    def gather_full(self, params: Sequence[ShardedParam], dtype: torch.dtype) -> list[torch.Tensor]:
        """Fresh full tensors of `params` through the unit's gather, synchronously (traced graphs)."""
        return gather_full(self.gather, params, dtype, self.rt.shard_group, self.rt.device)

    def start_reduce(self, params: Sequence[ShardedParam], grads: list[torch.Tensor | None],
                     dtype: torch.dtype, direct: bool = False, in_graph: bool = False) -> PendingReduce:
        """Pack the full gradients (or use a direct bucket's own) and start the reduce-scatter.

        Consumes `grads`: the list is emptied once packed, so the full-size gradients are freed
        before the collective runs (it may allocate its own temporaries). `in_graph` (a compiled
        graph's custom op, traced.py): on the current stream, no pool (the op's outputs must not
        share memory with what the next step reuses).
        """
        rt, plan = self.rt, self.plan(dtype)
        size = rt.shard_group.size
        inp = grad_as_input(params[0], grads[0], dtype, size, plan.pre_divide) if direct else None
        pooled = False
        if inp is None:
            numel = size * sum(row_sizes(params))
            buffer, pooled = self.scatter.allocate(numel, dtype, rt.device,
                                                   NO_POOL if in_graph else rt.pool)
            inp = pack_grads(params, grads, dtype, rt.device, size, plan.pre_divide, out=buffer)
        grads.clear()
        return self.start_scatter(params, inp, plan, pooled,
                                  None if in_graph else rt.reduce_stream)

    def start_scatter(self, params: Sequence[ShardedParam], inp: torch.Tensor, plan: ReducePlan,
                      pooled: bool = False, stream: Any = None) -> PendingReduce:
        """Start the reduce-scatter of a packed (group size, row) input on `stream` (None: current)."""
        rt = self.rt
        backend, device = rt.backend, rt.device
        # Packing ran on the compute stream (where the grads were made); the collective runs on
        # the reduce stream so the next unit's backward can proceed.
        stream = stream if stream is not None else backend.devices.current_stream(device)
        stream.wait_stream(backend.devices.current_stream(device))
        backend.devices.record_stream(inp, stream)
        with backend.devices.use_stream(stream):
            out = self.scatter.output(inp.shape[1], inp.dtype, device)
            work, finish = self.scatter.launch(out, inp, rt.shard_group, plan)
            event = backend.devices.new_event()
            event.record(stream)
        return PendingReduce(list(params), work, out, inp, plan, rt.shard_group, event, pooled,
                             finish)

    def reduced_row(self, pending: PendingReduce) -> torch.Tensor:
        """Wait for the reduce-scatter, reduce across replicas and divide (SUM plans): this rank's
        averaged row of the bucket, in the reduce dtype on the compute device; under fault
        tolerance then averaged over the replica groups outside this job."""
        rt = self.rt
        backend = rt.backend
        current = backend.devices.current_stream(pending.output.device)
        # The compute stream first waits for all the reduce stream queued (the collective's
        # launch included), then for the collective: a backend whose wait() ends with a copy on
        # the current stream (the cpu backend's reduce-scatter, built from an all-reduce, under
        # "cuda+gloo") then reads a result the compute stream is already ordered after. torch's
        # CUDA sanitizer, which counts a c10d op as a kernel of the stream that issued it,
        # reported the other order.
        if pending.event is not None:
            current.wait_event(pending.event)
        pending.work.wait()
        out, plan = pending.output, pending.plan
        backend.devices.record_stream(out, current)
        if pending.finish is not None:
            pending.finish(current)
        replica = rt.replica_group
        if replica is not None and replica.size > 1:
            self.replica.all_reduce(out, replica, plan.replica_op, plan.replica_factor)
        if plan.post_divide != 1.0:
            out.div_(plan.post_divide)
        if rt.cross_groups is not None:
            # After the divide: the row is this group's mean, and the mean of equal-size
            # groups' means is the mean over every sample that took part.
            with trace_range("shardkit::cross_group_all_reduce"):
                groups = rt.cross_groups.all_reduce_mean(out)
            if rt.stats is not None:
                rt.stats.all_reduce(out.numel() * out.element_size(), groups, crosses_node=True)
        share_replicated_scalars(pending.params, out, pending.group, backend, rt.stats)
        return out

    def finish_reduce(self, pending: PendingReduce) -> None:
        """Complete a bucket's reduction (reduced_row) and add it into the sharded grads."""
        out = self.reduced_row(pending)
        if pending.pooled:
            self.rt.pool.give(pending.input)
        params = pending.params
        # Cast (and move, with cpu_offload) the whole row once, then hand out views of it.
        masters = {(p.local.dtype, p.local.device) for p in params}
        if len(masters) == 1:
            dtype, dev = masters.pop()
            out = out.to(device=dev, dtype=dtype)
        for p, grad in zip(params, torch.split(out, row_sizes(params))):
            p.accumulate_grad(grad)


def choose(rt: CommRuntime, weight_block: int, grad_block: int,
           node_hops: tuple[Group, Group] | None, custom_gather: Any = None,
           custom_scatter: Any = None) -> UnitCollectives:
    """A unit's strategies: a user's comms where given, else exact or int8 blocks of the given
    sizes (0: exact; shard() and the custom-comm setters refuse a user's comm beside them)."""
    backend, stats = rt.backend, rt.stats
    exact = GatherComm(backend, stats)
    gather: GatherComm
    regather: GatherComm
    if custom_gather is not None:
        gather = regather = CustomGather(backend, stats, custom_gather)
    else:
        gather = QuantizedGather(backend, stats, weight_block) if weight_block else exact
        regather = exact  # the 1/k slices re-gathered in backward are decoded values already
    if custom_scatter is not None:
        scatter: ScatterComm = CustomScatter(backend, stats, custom_scatter)
    elif grad_block:
        scatter = QuantizedScatter(backend, stats, grad_block, node_hops)
    else:
        scatter = ScatterComm(backend, stats)
    return UnitCollectives(rt, gather=gather, regather=regather, scatter=scatter,
                           replica=(QuantizedReplicaReduce(backend, stats, grad_block)
                                    if grad_block else ReplicaReduce(backend, stats)))


def check_custom_comm(comm: Any, kind: str, takes_op: bool) -> None:
    """Refuse, naming what is missing, an object that cannot serve as a custom `kind` comm."""
    missing = [name for name, ok in (("allocate(size, *, dtype, device)",
                                      callable(getattr(comm, "allocate", None))),
                                     ("__call__", callable(comm))) if not ok]
    if missing:
        signature = ("(output_tensor, input_tensor, group, op, async_op=False)" if takes_op
                     else "(output_tensor, input_tensor, group, async_op=False)")
        raise ShardkitError(
            f"the custom {kind} ({type(comm).__name__}) has no {' and no '.join(missing)}; "
            f"HINT: give it allocate(size, *, dtype, device) -> Tensor and __call__{signature}"
            f" -> Work | None, as torch's FSDP2 {'ReduceScatter' if takes_op else 'AllGather'} "
            "has (an object written for fully_shard's set_custom_* works as it is)")
