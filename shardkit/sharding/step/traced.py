"""The engine inside a compiled graph: a unit's gather and reduce as two opaque custom ops.

Eagerly, hooks swap parameters, prefetch and queue reductions: Python state dynamo cannot
trace, so the eager hooks are `torch.compiler.disable`d and a compiled whole model breaks its
graph at every unit. When dynamo traces a unit's hooks itself (``torch.compile(model)``, with
or without ``fullgraph=True``), they take this path instead, which is all graph:

- ``shardkit::gather_unit(shards, key)`` returns the unit's full parameters in compute dtype
  (its fake implementation only makes the shapes); the module reads them as usual, so one graph
  spans every unit. Its autograd backward is ``shardkit::reduce_unit(grads, key)``: the unit's
  reduce-scatter (and replica all-reduce), averaged as the eager engine averages, returned as
  gradients of the shards, which autograd accumulates into ``.grad`` of the sharded parameters.
- Under resharding after forward (FULL_SHARD, HYBRID_SHARD, an int), the gather runs inside a
  non-reentrant checkpoint of its own: under compile every op of a checkpointed region is
  tagged for recompute, so the partitioner gathers again in backward instead of keeping every
  unit's full weights alive between forward and backward. (No selective-checkpoint context_fn:
  the region holds only the gather, and torch warns about in-place ops on every compile that
  passes one.) Where the
  unit keeps them (SHARD_GRAD_OP, NO_SHARD), the gathered tensors are saved for backward.

Both ops run the eager engine's own collective helpers, so numbers and comm_stats are the same;
``key`` (a string) names the unit in a registry of weak references (custom ops take no Python
objects).
What the graph cannot express keeps the eager hooks (with their graph breaks): no_sync (it
keeps full gradients between steps), cpu_offload and MixedPrecision.buffer_dtype (they swap
tensors on modules around forward), and backends whose capabilities refuse compilation.
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING

import torch
from torch.utils.checkpoint import checkpoint

from ...errors import ShardkitError
from .casts import cast_inputs
from .state import state_of
from .collectives import row_sizes

if TYPE_CHECKING:
    from .unit import ShardUnit

_UNITS: "weakref.WeakValueDictionary[str, ShardUnit]" = weakref.WeakValueDictionary()
_NEXT_KEY = itertools.count()


def forget_units() -> None:
    """Forget every unit's graph key (process_state.reset; the counter goes on: keys never repeat)."""
    _UNITS.clear()


def graph_key(unit: "ShardUnit") -> str:
    """The name the custom ops know `unit` by (assigned once per unit). A string: dynamo would
    turn an int that differs between units into a symbolic one, and hash nothing by it.

    It ends with this rank's row counts of the unit's parameters. The graph takes each DTensor
    parameter's local rows, whose count differs between ranks where rows do not divide evenly
    (7 rows: 4 and 3), but inductor's on-disk cache, which every rank and run on a machine
    shares, keys a graph by the DTensor's whole shape: a rank holding 3 rows loaded the graph
    compiled for 4 and failed its size check. The key is a constant of the graph, so the cache
    tells the two apart, and ranks holding equal rows still share one entry.
    """
    rows = ",".join(str(p.user_shape[0]) if p.user_shape else "-" for p in unit.params)
    key = f"unit{next(_NEXT_KEY)}:rows={rows}"
    _UNITS[key] = unit
    return key


def traced_refusal(unit: "ShardUnit") -> str:
    """Why `unit` keeps its eager hooks under dynamo ("" when its hooks can be traced)."""
    st = unit.state
    if st.backend.capabilities.compile_refusal:
        return st.backend.capabilities.compile_refusal
    if st.config.cpu_offload:
        return "cpu_offload moves shards between devices around forward"
    if st.config.mixed_precision.buffer_dtype is not None:
        return "MixedPrecision.buffer_dtype swaps the module's buffers around forward"
    return ""


def refuse_in_graph(unit: "ShardUnit") -> None:
    """Raise, while dynamo traces, why this unit's hooks stay eager (a graph break where allowed)."""
    raise ShardkitError(f"shardkit: unit {unit.name!r} cannot run inside one compiled graph: "
                        f"{traced_refusal(unit)}. HINT: compile without fullgraph=True (the "
                        "unit's hooks then run between graphs), or drop that setting")


def _unit(key: str) -> "ShardUnit":
    unit = _UNITS.get(key)
    if unit is None:
        raise ShardkitError(f"shardkit: the compiled graph names unit {key}, whose model is gone")
    return unit


@torch.library.custom_op("shardkit::gather_unit", mutates_args=())
def gather_unit(shards: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    """All-gather a unit's parameters: full tensors in compute dtype, in the unit's order."""
    unit = _unit(key)
    # `shards` are the unit's sharded parameters themselves (passed so autograd ties the
    # gradients to them); the helpers read the same tensors through the unit's buckets.
    full: dict[int, torch.Tensor] = {}
    for bucket in unit.gather_buckets:
        gathered = unit.collectives.gather_full(bucket.params, bucket.dtype)
        full.update((id(p), t) for p, t in zip(bucket.params, gathered))
    return [full[id(p)] for p in unit.params]


@gather_unit.register_fake
def _gather_shapes(shards: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    unit = _unit(key)
    return [s.new_empty(p.full_shape, dtype=p.compute_dtype, device=unit.state.device)
            for s, p in zip(shards, unit.params)]


@torch.library.custom_op("shardkit::reduce_unit", mutates_args=())
def reduce_unit(grads: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    """Reduce-scatter a unit's full gradients (trainable parameters, in order) into its shards'
    gradients, averaged over the data-parallel ranks, in the shards' dtype."""
    unit = _unit(key)
    st = state_of(unit)
    if st.no_sync:
        raise ShardkitError(
            "no_sync() under a whole-model compiled graph: the graph reduces every backward "
            "(it cannot keep full gradients between steps). HINT: compile the blocks instead "
            "(block.compile() on each unit), or accumulate by summing the losses of the "
            "micro-batches before one backward")
    trainable = [p for p in unit.params if p.requires_grad]
    by_param = dict(zip(map(id, trainable), grads))
    out: dict[int, torch.Tensor] = {}
    for bucket in unit.reduce_buckets:
        pending = unit.collectives.start_reduce(
            bucket.params, [by_param[id(p)] for p in bucket.params], bucket.dtype, in_graph=True)
        row = unit.collectives.reduced_row(pending)
        for p, grad in zip(bucket.params, torch.split(row, row_sizes(bucket.params))):
            # Copies: a custom op's outputs may not alias one another (they would share the row).
            out[id(p)] = p.user_rows(grad.view(p.shard_shape)).to(p.master_dtype, copy=True)
    return [out[id(p)] for p in trainable]


@reduce_unit.register_fake
def _reduce_shapes(grads: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    trainable = [p for p in _unit(key).params if p.requires_grad]
    return [g.new_empty(p.user_shape, dtype=p.master_dtype) for g, p in zip(grads, trainable)]


def _gather_backward(ctx, grads: list[torch.Tensor | None]) -> tuple:
    unit = _unit(ctx.key)
    trainable = [(p, g) for p, g in zip(unit.params, grads) if p.requires_grad]
    # A parameter forward did not use gets no gradient: it reduces as zeros, as eagerly.
    full = [g if g is not None else torch.zeros(p.full_shape, dtype=p.compute_dtype,
                                                 device=unit.state.device) for p, g in trainable]
    reduced = iter(reduce_unit(full, ctx.key))
    return [next(reduced) if p.requires_grad else None for p in unit.params], None


def _remember_key(ctx, inputs: tuple, output: object) -> None:
    ctx.key = inputs[1]


gather_unit.register_autograd(_gather_backward, setup_context=_remember_key)


def pre_forward(unit: "ShardUnit", module: torch.nn.Module, args: tuple, kwargs: dict):
    """Traced: put the unit's gathered parameters on their modules (and cast inputs)."""
    # A DTensor parameter enters as its local rows (to_local is differentiable: the gradient
    # comes back as a DTensor of the whole parameter, as eagerly).
    shards = [p.form.autograd_rows(p.sharded) for p in unit.params]
    if unit.reshard_after_forward is False:
        full = gather_unit(shards, unit.graph_key)
    else:
        full = checkpoint(gather_unit, shards, unit.graph_key, use_reentrant=False)
    for p, tensor in zip(unit.params, full):
        for owner, name in p.owners:
            owner._parameters[name] = tensor
    mp = unit.state.config.mixed_precision
    if mp.param_dtype is not None and mp.cast_forward_inputs:
        args, kwargs = cast_inputs(args, kwargs, mp.param_dtype)
    return args, kwargs


def post_forward(unit: "ShardUnit", module: torch.nn.Module, args: tuple, kwargs: dict, output):
    """Traced: put the shards back on their modules (the graph holds the gathered tensors)."""
    for p in unit.params:
        p.register(unsharded=False)
    return output
