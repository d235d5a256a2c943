"""`shardkit.plan()`: the engine's layout, memory and traffic for a model, without running it.

Nothing here allocates parameter memory or joins a process group: the units come from the
engine's own `plan_units`, each parameter's padding from the engine's `shard_layout`, and the
bytes sent are recorded into the engine's own `CommStats`, call for call as a training step
(one forward, one backward, no no_sync) issues them.

Assumed of the step: every unit runs forward once and backward reaches it (a unit whose params
are all frozen and whose inputs need no grad is not re-gathered for backward by the engine; the
plan still counts that gather), and gradients are synchronised (under no_sync nothing is
reduced).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn

from ..backend import Backend
from ..capabilities import AttentionCall, Capabilities, fused_attention_on_cpu
from ..errors import ShardkitError
from ..sharding.api import check_quantization_support
from ..sharding.step.buckets import collective_buckets
from ..sharding.step.traffic import CommStats
from ..sharding.step.whole_view import local_of
from ..sharding.setup.groups import shard_group_size
from ..sharding.step.layout import shard_layout
from ..sharding.setup.plan import ParamPlan, UnitPlan, plan_units
from ..sharding.policies import MixedPrecision, Quantization, ShardConfig, ShardingStrategy
from ..sharding.step.quantize import payload_bytes
from ..sharding.setup.mesh import check_tensor_parallel_options
from ..sharding.setup.reshard import ReshardSpec, resolve, unit_label
from ..sharding.wrap_policies import WrapPolicy, as_policy
from .activations import InputsFn
from .nodes import inter_node_by_rank, stat_kind
from .replay import Timeline
from .optimizers import state_tensors
from .recovery import with_recovery
from .result import Plan, UnitRow
from .tensor_parallel import (TPPlan, TensorParallel, data_parallel_shape, fake_world,
                              parallelized, resolve as resolve_tensor_parallel)
from .workload import Target, Workload, with_step


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ShardkitError(f"{name} must be a positive int, got {value!r}")
    return value


def plan_target(backend: object, shard_alignment: int | None) -> Target:
    """What the rehearsal takes the target to be: the named backend's declared capabilities
    and device type, else the host's defaults with `shard_alignment`."""
    cls = target_class(backend)
    if cls is None:
        align, _, _ = backend_facts(shard_alignment, None)
        return Target(Capabilities(shard_alignment=align), "cpu")
    return Target(cls.capabilities, cls.device_type)


def target_class(backend: object) -> type[Backend] | None:
    """The Backend class a plan targets, by name or object (None: none named); not started."""
    from ..job.selection import backend_class

    if backend is None:
        return None
    if isinstance(backend, Backend):
        return type(backend)
    if isinstance(backend, str):
        return backend_class(backend)
    raise ShardkitError(f"backend must be a name or a Backend, got {type(backend).__name__}")


def target_capabilities(backend: object) -> Capabilities | None:
    """The declared capabilities of the backend a plan targets, by name or object (None: none
    named, the planner's host defaults). A name is read from its registered class: not started."""
    cls = target_class(backend)
    return None if cls is None else cls.capabilities


def backend_facts(shard_alignment: int | None, backend: object
                  ) -> tuple[int, int | None, Callable[[AttentionCall], bool]]:
    """The shard alignment, Capabilities.direct_collective_numel and attention kernel choice of
    `backend` (or the defaults: alignment 1, no direct collectives, torch's CPU attention).

    A backend named by string is read from its registered class, never started: its device
    need not be on this machine (a laptop plans a GPU job)."""
    caps = target_capabilities(backend)
    if caps is not None:
        if shard_alignment is not None:
            raise ShardkitError("pass shard_alignment= or backend=, not both (the backend's "
                                "capabilities decide its alignment)")
        return caps.shard_alignment, caps.direct_collective_numel, caps.fused_attention
    return (_positive_int("shard_alignment", 1 if shard_alignment is None else shard_alignment),
            None, fused_attention_on_cpu)


class _Layout:
    """One distinct parameter's sizes under the plan's groups and dtypes: of what this rank holds
    of it (TP's local part of a tensor-parallel parameter; `whole` counts the parameter)."""

    def __init__(self, plan: ParamPlan, group: int, alignment: int, config: ShardConfig) -> None:
        self.whole = plan.param.numel()
        param = local_of(plan.param)
        self.numel = param.numel()
        self.trainable = plan.param.requires_grad  # (a DTensor's local tensor does not say)
        self.master_bytes = param.dtype.itemsize
        self.compute_dtype = config.compute_dtype(param.dtype)
        self.reduce_dtype = config.reduce_dtype(param.dtype)
        layout = shard_layout(param.shape, group, alignment)
        self.padded, self.shard = layout.padded_numel, layout.shard_numel


def plan(model: nn.Module, world_size: int, strategy: ShardingStrategy | str = "FULL_SHARD",
         auto_wrap_policy: WrapPolicy | Callable[[nn.Module], bool] | None = None,
         mixed_precision: MixedPrecision | None = None, cpu_offload: bool = False,
         optimizer: str = "adam", hybrid_group_size: int | None = None,
         shard_alignment: int | None = None, backend: object = None, prefetch: int = 1,
         reshard_after_forward: ReshardSpec = None, batch: int | None = None,
         seq: int | None = None, activation_checkpointing: bool = False,
         example_inputs: InputsFn | None = None, nodes: int | None = None,
         threads_per_rank: int | None = None, quantize: Quantization | None = None,
         fault_tolerant: bool = False, tp: int | None = None, tp_plan: TPPlan | None = None
         ) -> Plan:
    """Predict per-rank memory and bytes sent per step for `model` sharded as shard() would.

    The model may live on the meta device (nothing is allocated; a 70B config plans in seconds).
    - world_size, strategy, auto_wrap_policy, mixed_precision, cpu_offload, prefetch and
      hybrid_group_size mean what they mean for shardkit.shard(); hybrid_group_size defaults to
      the ranks per node when `nodes` is given, else world_size (shard() defaults to the local
      world size).
    - nodes: the ranks are spread over this many nodes, numbered node by node as torchrun does;
      comm["inter_node_by_rank"] then says, per rank, the bytes sent to another node per step
      (what comm_stats(model)["inter_node"] counts on that rank).
    - optimizer: "adam", "adamw", "adadelta" or "sgd" (the state tensors kept per parameter).
    - shard_alignment: pad shards to multiples of this many elements, or backend=<name> to take
      the alignment from that backend's capabilities (read from its registered class: it is not
      started, and its device need not be on this machine), and with it which large parameters
      get collectives of their own (Capabilities.direct_collective_numel; without a backend,
      none do) and which attention calls run fused (Capabilities.fused_attention).
    - reshard_after_forward: None (the strategy's default), True, False, or an int k dividing
      the shard group size: after forward each rank keeps its 1/k slice of the unit, and
      backward all-gathers inside its block of k ranks. A dict {unit name: value} sets it per
      unit ("<root>" is the root), or a callable (unit name, module) -> value, as in shard().
    - batch (per rank), seq: simulate one forward + backward at that size on the meta device
      to include activations in the peak (Plan.step_bytes). Language models get input_ids of
      (batch, seq) (and labels, decoder_input_ids where their forward takes them); any other
      model needs example_inputs=fn(batch, seq) -> (args, kwargs) of meta tensors.
      activation_checkpointing=True simulates shardkit.wrap.checkpoint_layers on every unit
      below the root. The step is the real one: shard() and the optimizer run on a meta copy
      of the model under a backend that moves no bytes (planner/rehearsal.py).
    - quantize: shardkit.Quantization, as for shard(): the quantized collectives' bytes (int8
      codes plus a 4-byte scale per block) in comm, and their buffers in the rehearsed step.
    - fault_tolerant: HYBRID_SHARD with shard(..., fault_tolerance=...), the replica groups
      being world_size / hybrid_group_size separate jobs: Plan.recovery_bytes is the copy of its
      state a rejoining rank receives, inside the peak where the device is the host
      (planner/recovery.py); the traffic is HYBRID_SHARD's (the all-reduce across groups sends
      what the replicas' all-reduce sends).
    - threads_per_rank: intra-op threads per rank (default this process's), for kernels whose
      scratch grows with them (Capabilities.kernel_workspace).
    - tp: torch's tensor parallelism inside, shardkit across (docs/guide/tensor-parallel.md):
      world_size ranks as (data parallel..., tp), TP's groups of `tp` consecutive ranks inside a
      node. tp_plan: fn(model, tp_mesh) calling parallelize_module as the training script does,
      or a dict {module path: ParallelStyle or transformers style name}; default, the model's own
      `tp_plan` (transformers). The plan is applied to a meta copy on torch's fake process
      groups (planner/tensor_parallel.py): strategy, hybrid_group_size and the bytes in comm
      are the data-parallel dimension's, sharding what TP left each rank; with batch=,
      comm["tp"] is TP's own collectives counted as the rehearsed step issued them.
    The returned Plan's docstring says what its peak includes.
    """
    if not isinstance(model, nn.Module):
        raise ShardkitError(f"plan() needs an nn.Module, got {type(model).__name__}")
    world = _positive_int("world_size", world_size)
    config = ShardConfig.build(strategy, mixed_precision, cpu_offload, prefetch, hybrid_group_size,
                               quantization=quantize)
    target_cls = target_class(backend)
    if target_cls is not None:
        check_quantization_support(config.quantization, target_cls)  # shard()'s own refusal
    strat, mp = config.strategy, config.mixed_precision
    n_states = state_tensors(optimizer)
    if hybrid_group_size is not None:
        _positive_int("hybrid_group_size", hybrid_group_size)
    per_node = _ranks_per_node(world, nodes)
    tensor_parallel = resolve_tensor_parallel(tp, tp_plan, model, world)
    tp_size = 1 if tensor_parallel is None else tensor_parallel.size
    if tensor_parallel is not None:
        _check_tensor_parallel_plan(config, fault_tolerant, tp_size, per_node)
    dp_world = world // tp_size
    # shard() defaults HYBRID's group to the local world size: the ranks per node when `nodes`
    # says it, else (a plan made off the cluster) the world size, as the docstring says.
    group = shard_group_size(strat, hybrid_group_size, per_node // tp_size, dp_world)
    replicas = dp_world // group
    align, direct, attention = backend_facts(shard_alignment, backend)
    laid_out = model if tensor_parallel is None else _tensor_parallel_twin(
        model, tensor_parallel, world, data_parallel_shape(strat.name, dp_world, group))
    units = plan_units(laid_out, as_policy(auto_wrap_policy))
    if not any(u.params for u in units):
        raise ShardkitError(f"plan() got a model with no parameters ({type(model).__name__})")
    names = [unit_label(u.name) for u in units]
    # The engine's own normalisation: the same values, defaults and errors as shard().
    per_unit = dict(zip(names, resolve(reshard_after_forward, units, config, group)))
    rows, split, stats = _rows_and_traffic(units, names, per_unit, group, replicas, align,
                                           direct, config, n_states, per_node)
    result = _assemble(rows, split, stats, world, strat, group, replicas, align, optimizer, mp,
                       bool(cpu_offload), prefetch, _quantized(config.quantization))
    if tensor_parallel is not None:
        result = dataclasses.replace(result, tensor_parallel=tp_size,
                                     tp_plan=tensor_parallel.source)
    if fault_tolerant:
        result = with_recovery(result, plan_target(backend, shard_alignment).device_type)
    if nodes is not None:
        calls = [c for row in rows for c in row.collectives]
        result.comm["nodes"] = nodes
        # A data-parallel rank's TP ranks share its node (TP inside): the data-parallel groups
        # cross nodes as they would in a world of dp_world ranks with per_node / tp per node.
        by_dp_rank = inter_node_by_rank(calls, dp_world, group, per_node // tp_size)
        result.comm["inter_node_by_rank"] = [by_dp_rank[r // tp_size] for r in range(world)]
    if batch is None:
        if seq is not None or activation_checkpointing or example_inputs is not None:
            raise ShardkitError("seq, activation_checkpointing and example_inputs need batch= "
                                "(the per-rank batch size to simulate)")
        return result
    batch = _positive_int("batch", batch)
    options = dict(auto_wrap_policy=auto_wrap_policy, mixed_precision=mixed_precision,
                   prefetch=prefetch, hybrid_group_size=group if replicas > 1 else None,
                   reshard_after_forward=reshard_after_forward, quantize=quantize)
    target = plan_target(backend, shard_alignment)
    workload = Workload(model, None if seq is None else _positive_int("seq", seq), example_inputs,
                        options, optimizer, target, threads(threads_per_rank), tensor_parallel)
    timeline = workload.timeline(world, strat.name, bool(cpu_offload), activation_checkpointing,
                                 batch)
    # The rehearsed peak replaces the static one: the recovery copy is added to it afresh.
    stepped = step_plan(result, timeline, target, batch, seq, activation_checkpointing)
    if tensor_parallel is not None:  # TP's traffic moves activations: known from a step alone
        stepped.comm["tp"] = workload.rehearsal(world, strat.name, bool(cpu_offload),
                                                activation_checkpointing, batch).tp_comm
    return with_recovery(stepped, target.device_type) if fault_tolerant else stepped


def _check_tensor_parallel_plan(config: ShardConfig, fault_tolerant: bool, tp: int,
                                per_node: int) -> None:
    """Refuse what shard() refuses beside TP, and a TP group that would span nodes."""
    check_tensor_parallel_options(config.strategy, False, False, config.cpu_offload,
                                  bool(config.quantization.weights or config.quantization.gradients))
    if fault_tolerant:
        raise ShardkitError("fault_tolerant plans and tp= do not go together: shard() takes a "
                            "mesh (which TP needs) without fault_tolerance=. HINT: plan one of "
                            "the two")
    if per_node % tp:
        raise ShardkitError(
            f"tp={tp} does not divide the {per_node} ranks per node: TP's groups are consecutive "
            "ranks inside a node (its collectives run on every layer). HINT: a tp that divides "
            "the ranks per node (torchtitan's recipe: TP within a node, data parallel across)")


def _tensor_parallel_twin(model: nn.Module, tensor_parallel: TensorParallel, world: int,
                          dp_shape: tuple[int, ...]) -> nn.Module:
    """A meta copy of the model as TP leaves it on rank 0 (DTensor parameters, local parts)."""
    with fake_world(world, dp_shape, tensor_parallel.size) as mesh:
        return parallelized(model, tensor_parallel, mesh)


def threads(threads_per_rank: int | None) -> int:
    """The intra-op threads each rank runs with: as given, else this process's."""
    if threads_per_rank is None:
        return torch.get_num_threads()
    return _positive_int("threads_per_rank", threads_per_rank)


def _ranks_per_node(world: int, nodes: int | None) -> int:
    if nodes is None:
        return world
    _positive_int("nodes", nodes)
    if world % nodes:
        raise ShardkitError(f"world_size {world} does not split evenly over {nodes} nodes; "
                            "HINT: torchrun starts the same number of ranks on every node")
    return world // nodes


def step_plan(static: Plan, timeline: Timeline, target: Target, batch: int, seq: int | None,
              activation_checkpointing: bool) -> Plan:
    """`static` with the peak of the rehearsed step at `batch` included."""
    return with_step(static, timeline, target.capabilities, batch, seq,
                     activation_checkpointing)


def _rows_and_traffic(units: list[UnitPlan], names: list[str], per_unit: dict[str, bool | int],
                      group: int, replicas: int, align: int, direct: int | None,
                      config: ShardConfig, n_states: int,
                      per_node: int) -> tuple[list[UnitRow], dict[str, int], CommStats]:
    stats = CommStats()
    split = {"params": 0, "grads": 0, "optimizer": 0}
    rows: list[UnitRow] = []
    layouts = [[_Layout(p, group, align, config) for p in u.params] for u in units]
    def gathers(params: list[_Layout]) -> list:
        return collective_buckets(params, lambda p: p.compute_dtype, direct)

    calls: list[list[tuple[str, int, int]]] = [[] for _ in units]  # per unit, in issue order
    quant = config.quantization

    def issue(unit: int, kind: str, nbytes: int, size: int) -> None:
        counted = stat_kind(kind)
        if kind.startswith("a2a_"):
            stats.all_to_all(counted, nbytes, size)
        elif kind.endswith("gather"):
            stats.all_gather(nbytes, size, kind=counted)
        else:
            getattr(stats, kind)(nbytes, size)
        calls[unit].append((kind, nbytes, size))

    def gathered_bytes(bucket) -> int:
        row = sum(p.shard for p in bucket.params)
        if quant.weights and group > 1:
            return payload_bytes(row, quant.block_size)
        return row * bucket.dtype.itemsize

    for i, params in enumerate(layouts):  # forward: every unit is gathered once
        for bucket in gathers(params):
            issue(i, "forward_gather", gathered_bytes(bucket), group)
    for i in reversed(range(len(units))):  # backward, root first
        params, reshard = layouts[i], per_unit[names[i]]
        for bucket in gathers(params):
            size = bucket.dtype.itemsize
            if reshard is True:
                issue(i, "backward_gather", gathered_bytes(bucket), group)
            elif reshard is not False:  # kept 1/k slices, gathered back inside k ranks
                issue(i, "backward_gather", sum(p.padded // reshard for p in bucket.params) * size,
                      reshard)
        trainable = [p for p in params if p.trainable]
        for bucket in collective_buckets(trainable, lambda p: p.reduce_dtype, direct):
            row = sum(p.shard for p in bucket.params)
            if quant.gradients:
                for kind, chunk, size in quantized_reduction(row, group, replicas, per_node,
                                                             quant.block_size):
                    issue(i, kind, chunk, size)
                continue
            issue(i, "reduce_scatter", row * bucket.dtype.itemsize, group)
            if replicas > 1:
                issue(i, "all_reduce", row * bucket.dtype.itemsize, replicas)
        name = names[i]
        # Shards and the optimizer live in the master dtype; reduced grads are cast to it too.
        shard_bytes = sum(p.shard * p.master_bytes for p in params)
        trainable_shard = sum(p.shard * p.master_bytes for p in params if p.trainable)
        split["params"] += shard_bytes
        split["grads"] += trainable_shard
        split["optimizer"] += trainable_shard * n_states
        rows.append(UnitRow(
            name=name, params=sum(p.whole for p in params),
            trainable=sum(p.whole for p in params if p.trainable),
            padded_numel=sum(p.padded for p in params), shard_numel=sum(p.shard for p in params),
            persistent_bytes=shard_bytes + trainable_shard * (1 + n_states),
            unsharded_bytes=sum(p.padded * p.compute_dtype.itemsize for p in params),
            grad_bytes=sum(p.numel * p.compute_dtype.itemsize for p in params if p.trainable),
            reshard_after_forward=reshard,
            # Direct buckets reduce-scatter straight out of the gradient: no flat input buffer.
            reduce_bytes=sum(p.padded * p.reduce_dtype.itemsize
                             for bucket in collective_buckets(trainable, lambda p: p.reduce_dtype,
                                                              direct)
                             if not bucket.direct for p in bucket.params),
            grad_shard_bytes=trainable_shard, collectives=tuple(calls[i])))
    rows.reverse()  # the engine's unit order: bottom-up, root last
    return rows, split, stats


def quantized_reduction(row: int, group: int, replicas: int, per_node: int,
                        block: int) -> list[tuple[str, int, int]]:
    """(call kind, chunk bytes per peer, ranks) of one bucket's quantized reduction, as the engine
    issues it: the shard group's all-to-all (in two hops where it spans nodes), then the
    replicas' all-to-all and all-gather of 1/replicas slices."""
    calls = []
    if group > 1:
        if 1 < per_node < group and group % per_node == 0:
            nodes = group // per_node
            calls += [("a2a_node", nodes * payload_bytes(row, block), per_node),
                      ("a2a_across", payload_bytes(row, block), nodes)]
        else:
            calls.append(("a2a_reduce_scatter", payload_bytes(row, block), group))
    if replicas > 1:
        width = payload_bytes(-(-row // replicas), block)
        calls += [("a2a_all_reduce", width, replicas), ("all_reduce_gather", width, replicas)]
    return calls


def _peak(rows: list[UnitRow], persistent_device: int, prefetch: int) -> int:
    """Persistent + root and (1 + prefetch) largest other units gathered with grads + kept state."""
    root, others = rows[-1], rows[:-1]
    busy = sorted(others, key=lambda u: u.unsharded_bytes + u.grad_bytes, reverse=True)
    active = busy[:1 + prefetch]
    kept = 0
    for u in busy[1 + prefetch:]:
        if u.reshard_after_forward is False:
            kept += u.unsharded_bytes
        elif u.reshard_after_forward is not True:
            kept += u.unsharded_bytes // u.reshard_after_forward
    return (persistent_device + root.unsharded_bytes + root.grad_bytes
            + sum(u.unsharded_bytes + u.grad_bytes for u in active) + kept)


def _assemble(rows: list[UnitRow], split: dict[str, int], stats: CommStats, world: int, strat: ShardingStrategy,
              group: int, replicas: int, align: int, optimizer: str, mp: MixedPrecision,
              cpu_offload: bool, prefetch: int, quantized: str) -> Plan:
    snap = stats.snapshot()
    comm = {k: snap[k] for k in ("all_gather", "reduce_scatter", "all_reduce", "total", "calls")}
    persistent = dict(split, total=sum(split.values()))
    device = 0 if cpu_offload else persistent["total"]
    largest = max(rows, key=lambda u: u.unsharded_bytes)
    return Plan(world_size=world, strategy=strat.name, shard_group_size=group,
                replica_group_size=replicas, shard_alignment=align, optimizer=optimizer.lower(),
                param_dtype=_dtype_name(mp.param_dtype),
                reduce_dtype=_dtype_name(mp.reduce_dtype or mp.param_dtype),
                cpu_offload=cpu_offload, prefetch=prefetch, units=tuple(rows),
                param_count=sum(u.params for u in rows),
                trainable_count=sum(u.trainable for u in rows), persistent=persistent,
                persistent_device=device, persistent_host=persistent["total"] - device,
                largest_unit=largest.name, largest_unit_bytes=largest.unsharded_bytes,
                peak_bytes=_peak(rows, device, prefetch), comm=comm, quantized=quantized)


def _quantized(quant: Quantization) -> str:
    """What the plan's line says travels as int8 blocks ("" for nothing)."""
    what = [name for name, on in (("weights", quant.weights), ("gradients", quant.gradients)) if on]
    return f"{' + '.join(what)} (block {quant.block_size})" if what else ""


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "" if dtype is None else str(dtype).replace("torch.", "")
