"""Module and autograd hooks that drive each unit through forward and backward."""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten
from typing_extensions import override

from ...errors import ShardkitError
from ...failure import where
from .state import state_of
from . import traced
from .casts import cast_floats, cast_inputs
from .trace import trace_range
from .unit import ShardUnit


# What autograd keeps of a step holds units weakly: a graph outlives its backward as long as the
# user keeps any tensor of it (the last `loss` in a notebook, a logged output), and through a
# strong reference it would keep the whole model alive after `del model`.
class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs once the unit's whole backward is done."""

    @override
    @staticmethod
    def forward(ctx, unit: ShardUnit, *inputs: torch.Tensor):
        """Pass the inputs through unchanged, remembering the unit (weakly)."""
        ctx.unit = weakref.ref(unit)
        return inputs

    @override
    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        """Grads reached the unit's inputs: once every forward call's backward is done, reduce."""
        unit = ctx.unit()
        if unit is None:  # the model is gone: nothing left to reduce into
            return (None, *grads)
        unit.forward_uses -= 1
        if unit.forward_uses == 0 and unit.needs_post_backward:
            unit.state.post_backward(unit)
        return (None, *grads)


# module -> the unit whose hooks it carries. Weak on both sides: a unit refers to its module,
# so a strong value would keep its own key, and with it the whole model, alive for the life of
# the process (issue 33). The model keeps its units (model -> engine state -> units).
_UNIT_OF: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref[ShardUnit]]" = \
    weakref.WeakKeyDictionary()


def forget_units() -> None:
    """Forget every module's unit (process_state.reset)."""
    _UNIT_OF.clear()


def unit_of(module: torch.nn.Module) -> ShardUnit | None:
    """The unit whose forward hooks `module` carries, or None for a module that is not a unit."""
    ref = _UNIT_OF.get(module)
    return None if ref is None else ref()


def cast_outputs(unit: ShardUnit, module: torch.nn.Module, args: tuple, kwargs: dict,
                 output: Any) -> Any:
    """Cast the model's floating-point outputs to MixedPrecision.output_dtype (root unit only)."""
    dtype = unit.state.config.mixed_precision.output_dtype
    return output if dtype is None else cast_floats(output, dtype)


def _route_through_post_backward(unit: ShardUnit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    leaves, spec = tree_flatten((args, kwargs))
    idx = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not idx:
        return args, kwargs
    outs = _PostBackward.apply(unit, *[leaves[i] for i in idx])
    for i, t in zip(idx, outs):
        leaves[i] = t
    unit.forward_uses += 1
    return tree_unflatten(leaves, spec)


def pre_forward(unit: ShardUnit, module: torch.nn.Module, args: tuple, kwargs: dict):
    """Gather the unit before its forward: as graph ops where dynamo traces this hook
    (torch.compile(model) or torch.compile(unit): traced.py), else eagerly."""
    if torch.compiler.is_compiling():
        if unit.traceable:
            return traced.pre_forward(unit, module, args, kwargs)
        traced.refuse_in_graph(unit)
    return eager_pre_forward(unit, module, args, kwargs)


def post_forward(unit: ShardUnit, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any):
    """Reshard the unit after its forward: traced where pre_forward was, else eagerly."""
    if torch.compiler.is_compiling() and unit.traceable:
        return traced.post_forward(unit, module, args, kwargs, output)
    return eager_post_forward(unit, module, args, kwargs, output)


# The eager hooks never run inside a compiled graph: they issue collectives, swap parameters
# and keep Python state (dynamo would break the graph on each, and guard on buffers that change
# identity every step: the recompile storm of issue 17). Where the unit's forward alone is
# compiled (block.compile()), they run around
# the compiled code; where dynamo traces the hooks themselves, traced.py's path runs instead.
@torch.compiler.disable
def eager_pre_forward(unit: ShardUnit, module: torch.nn.Module, args: tuple, kwargs: dict):
    """Gather the unit (waiting on a prefetch if one is in flight) and prefetch the next ones."""
    if unit.in_forward_method:  # the registered method around this call ran the hook already
        return args, kwargs
    with trace_range(unit.trace_names["pre_forward"]):
        st = state_of(unit)
        where.forward_started(unit.name, outermost=unit is st.root_unit)
        if unit is st.root_unit:
            st.on_root_pre_forward()
        st.record_pre_forward(unit)
        unit.to_unsharded()
        st.prefetch_forward(unit)
        mp = st.config.mixed_precision
        if mp.buffer_dtype is not None:
            unit.cast_buffers(mp.buffer_dtype)
        if mp.param_dtype is not None and mp.cast_forward_inputs:
            args, kwargs = cast_inputs(args, kwargs, mp.param_dtype)
        if torch.is_grad_enabled():
            args, kwargs = _route_through_post_backward(unit, args, kwargs)
        return args, kwargs


@torch.compiler.disable
def eager_post_forward(unit: ShardUnit, module: torch.nn.Module, args: tuple, kwargs: dict,
                       output: Any):
    """Put the sharded params back, reshard as the unit says (free / keep / 1/k), hook the outputs."""
    if unit.in_forward_method:
        return output
    with trace_range(unit.trace_names["post_forward"]):
        st = state_of(unit)
        st.record_post_forward(unit)
        unit.restore_buffers()
        backward_follows = torch.is_grad_enabled()
        if not st.keep_unsharded:
            unit.after_forward(backward_follows)
        if backward_follows:
            tensors = [t for t in tree_flatten(output)[0]
                       if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                unit.forward_ran()
                for t in tensors:
                    t.register_hook(functools.partial(_pre_backward, weakref.ref(unit)))
        if unit is st.root_unit:
            st.on_root_post_forward()
        where.forward_finished(unit.name)
        return output


def _pre_backward(unit_ref: "weakref.ref[ShardUnit]", grad: torch.Tensor) -> None:
    unit = unit_ref()
    if unit is None:  # a backward through the graph of a model that is gone
        return
    st = state_of(unit)
    where.enter(unit.name, "backward")
    st.queue_finalizer()
    if not unit.backward_started:
        with trace_range(unit.trace_names["pre_backward"]):
            unit.backward_reached()
            # Exposed, not only gathered: activation checkpointing recomputes the forward from
            # the module's parameters.
            unit.to_unsharded()
            st.prefetch_backward(unit)
            # Backward holds the gathered params and their full grads at once; idle kept
            # buffers on top of that would raise the peak, so backward allocates afresh
            # (forward still reuses).
            st.pool.clear()


def install(unit: ShardUnit) -> list:
    """Register the forward hooks of one unit on its module; return the removable handles."""
    module = unit.module
    _UNIT_OF[module] = weakref.ref(unit)
    # Bound by partial, which has no frame of its own for dynamo to start tracing at.
    _never_a_graph_of_their_own()
    unit.graph_key = traced.graph_key(unit)
    unit.traceable = not traced.traced_refusal(unit)
    handles = [
        module.register_forward_pre_hook(functools.partial(pre_forward, unit), with_kwargs=True,
                                         prepend=True),
        module.register_forward_hook(functools.partial(post_forward, unit), with_kwargs=True,
                                     always_call=False),
    ]
    # module.compile() compiles the module's forward only, so its hooks stay outside the graph
    # (Module.compile would compile __call__, hooks included).
    module.compile = _compile_method(unit)  # type: ignore[method-assign]
    if unit is state_of(unit).root_unit and unit.state.config.mixed_precision.output_dtype is not None:
        # Root only: inner units' outputs feed the root's own layers, which compute in param_dtype.
        handles.append(module.register_forward_hook(functools.partial(cast_outputs, unit),
                                                    with_kwargs=True))
    return handles + _guard_layers(unit)


@functools.cache
def _never_a_graph_of_their_own() -> None:
    # torch.compile(unit) runs the unit's hooks outside its graph, and dynamo would compile each
    # hook as a frame of its own: a graph with the gather beside every unit's graph (twice
    # FSDP2's count). Skipped as frames, they run eagerly there; dynamo still inlines them where
    # it traces the module call that runs them (a compiled parent: traced.py's path).
    from torch._dynamo.eval_frame import skip_code

    skip_code(pre_forward.__code__)
    skip_code(post_forward.__code__)


def _compile_method(unit: ShardUnit):
    def compile(**kwargs: Any) -> None:
        """torch.compile this unit's forward in place (keyword arguments are torch.compile's)."""
        compile_unit(unit, **kwargs)
    return compile


def compile_unit(unit: ShardUnit, **kwargs: Any) -> None:
    """torch.compile a unit's forward in place (keyword arguments are torch.compile's), unless the
    backend's capabilities say its device cannot (Capabilities.compile_refusal)."""
    refusal = unit.state.backend.capabilities.compile_refusal
    if refusal:
        raise ShardkitError(refusal)
    unit.module.forward = torch.compile(unit.module.forward, **kwargs)


def _guard_layers(unit: ShardUnit) -> list:
    """Make each layer holding this unit's parameters refuse a call while they are row shards.

    A shard keeps its parameter's dimensions, so a layer called directly (outside the model's
    forward and any registered method) would not fail on shapes: a Linear would return this
    rank's slice of the features and an Embedding would look rows up in the wrong table. Added
    after the unit's own pre-forward hook, which exposes the gathered parameters first.
    """
    owned: dict[torch.nn.Module, list] = {}
    for sp in unit.params:
        if sp.shard_shape != sp.full_shape:
            for module, name in sp.owners:
                owned.setdefault(module, []).append((name, sp))
    # Hooks are partials, never lambdas with default arguments: dynamo caches a spec of every
    # function it inlines, keyed weakly by the function but holding its defaults strongly, and
    # defaults reaching the unit would keep the whole model alive for the life of the process.
    return [module.register_forward_pre_hook(functools.partial(_refuse_if_sharded, pairs))
            for module, pairs in owned.items()]


def _refuse_if_sharded(pairs: list, module: torch.nn.Module, args: tuple) -> None:
    if torch.compiler.is_compiling():  # compiled code runs only inside forward
        return
    for name, sp in pairs:
        if module._parameters.get(name) is sp.sharded:
            raise ShardkitError(
                f"{type(module).__name__} holding {sp.fqn!r} was called outside the sharded "
                f"model's forward, while this rank holds only rows of it ({tuple(sp.shard_shape)} "
                f"of {tuple(sp.full_shape)}): it would compute with a slice of the weight. HINT: "
                "call it through the model's forward, register the method that calls it with "
                "shardkit.register_forward_method(model, 'method_name'), or call it inside "
                "`with model.unshard():`")
