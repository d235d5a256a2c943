"""Methods a sharded model gains: no_sync(), unshard(), gradient-sync and prefetch control, clear
errors for deepcopy and for a dtype or device change (model.to(torch.bfloat16)), and access to
its engine state."""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from ...errors import ShardkitError
from ..step.comms import check_custom_comm
from ..step.state import ShardState
from ..step.unit import ShardUnit
from ..step.whole_view import local_of

STATE_ATTR = "_shardkit_state"
# original class -> its Sharded subclass: one class per model class, however many models shard().
# Weak on both sides (the subclass refers to its base): a class defined in a notebook cell, and
# its subclass, go once no model of it is left.
_SHARDED_CLASSES: "weakref.WeakKeyDictionary[type, weakref.ref[type]]" = weakref.WeakKeyDictionary()
_CLASSES_LOCK = threading.Lock()


def forget_classes() -> None:
    """Forget the Sharded subclasses made so far (process_state.reset)."""
    with _CLASSES_LOCK:
        _SHARDED_CLASSES.clear()


def get_state(module: object) -> ShardState:
    """Return the engine state of a model returned by shardkit.shard(), or raise a clear error."""
    state = module.__dict__.get(STATE_ATTR)
    if state is None:
        raise ShardkitError(f"{type(module).__name__} is not a sharded model; HINT: pass the module "
                            "returned by shardkit.shard(model, ...)")
    return state


class ShardedModule:
    """Mixin placed in front of the model's own class by shardkit.shard()."""

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (unsharded, no communication) until the context exits."""
        state = get_state(self)
        previous, state.no_sync = state.no_sync, True
        try:
            yield
        finally:
            state.no_sync = previous

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """Turn gradient reduction off (False) or back on (True) until changed; no_sync() without a context.

        Under False, backward skips the reduce-scatter and gradients accumulate unsharded, on the
        gathered parameters (as under no_sync() and FSDP2): between micro-batches each rank holds
        one full-size gradient per trainable parameter, sum(numel) x the compute dtype's bytes
        (param_dtype under MixedPrecision). The first backward after True reduces the sum.
        """
        if not isinstance(requires_gradient_sync, bool):
            raise ShardkitError("set_requires_gradient_sync() takes True or False, got "
                                f"{requires_gradient_sync!r}")
        get_state(self).no_sync = not requires_gradient_sync

    def set_forward_prefetch(self, unit: nn.Module | str, prefetch: Sequence[nn.Module | str]) -> None:
        """When `unit` runs its pre-forward, issue the all-gathers of exactly the units in `prefetch`.

        Units are given as the wrapped modules or their names ("<root>" for the root). This replaces
        the bounded `prefetch=` order for that unit only; an empty list turns its forward prefetch off.
        """
        state = get_state(self)
        _find_unit(state, unit).forward_prefetch = _find_units(state, prefetch)

    def set_backward_prefetch(self, unit: nn.Module | str, prefetch: Sequence[nn.Module | str]) -> None:
        """When `unit` runs its pre-backward, issue the all-gathers of exactly the units in `prefetch`.

        As set_forward_prefetch(): modules or unit names; replaces the bounded order for that unit.
        Units whose backward already ran, or that are still gathered, are skipped.
        """
        state = get_state(self)
        _find_unit(state, unit).backward_prefetch = _find_units(state, prefetch)

    def set_custom_all_gather(self, comm: Any) -> None:
        """Run every unit's parameter all-gather through `comm` (FSDP2's AllGather); None: the built-in.

        `comm` is what torch's `fully_shard` module takes in `set_custom_all_gather`: an object
        with `allocate(size, *, dtype, device) -> Tensor` (the gathered output's buffer) and
        `__call__(output_tensor, input_tensor, group, async_op=False) -> Work | None`, given
        torch's ProcessGroup; `input_tensor` is this rank's row of `output_tensor`. It is called
        exactly where the built-in all-gather would be (the same bytes, on the gather stream,
        async where that was), for the shard group and the k-rank groups of
        reshard_after_forward=k; a one-rank group copies locally without it. Saving and
        state_dict() keep the built-in gather (exact values). Call between steps.
        """
        _set_custom_comm(get_state(self), "all_gather", comm)

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Run every unit's gradient reduce-scatter through `comm` (FSDP2's ReduceScatter); None: the built-in.

        `comm` has `allocate(size, *, dtype, device) -> Tensor` (the packed input's and the
        reduced row's buffers) and `__call__(output_tensor, input_tensor, group, op,
        async_op=False) -> Work | None`, given torch's ProcessGroup and always
        `torch.distributed.ReduceOp.SUM`: the engine divides around it (the mean over the
        data-parallel ranks), so a comm only has to sum. It is called exactly where the built-in
        reduce-scatter would be (the same bytes, asked async_op=True so the reduction overlaps
        the next unit's backward); HYBRID_SHARD's all-reduce across replicas and fault
        tolerance's cross-group mean follow it as before. Call between steps.
        """
        _set_custom_comm(get_state(self), "reduce_scatter", comm)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """Refuse a dtype or device change of the shards (model.to(torch.bfloat16), .half(), .cpu()).

        torch would convert the shards in place, and the engine, which gathers into buffers of
        the compute dtype and device chosen at shard(), would go on computing as before: a
        model.to(torch.bfloat16) made bf16 master weights with fp32 compute, silently. A call
        that changes nothing (model.to(the same device), share_memory()) goes through.
        """
        params = list(get_state(self).iter_params())
        for sp in params:
            moved = fn(sp.local)
            if moved.dtype != sp.local.dtype:
                raise ShardkitError(
                    f"changing the dtype of a sharded model ({sp.local.dtype} -> {moved.dtype}, "
                    "e.g. model.to(dtype), .half(), .bfloat16()) after shardkit.shard() is not "
                    "supported: the shards are the optimizer's master weights and the engine's "
                    "compute dtype was fixed at shard(). HINT: for "
                    f"{moved.dtype} compute with {sp.local.dtype} master weights, pass "
                    f"mixed_precision=shardkit.MixedPrecision(param_dtype={moved.dtype}) to "
                    f"shard(); for {moved.dtype} master weights, convert the model before shard()")
            if moved.device != sp.local.device:
                raise ShardkitError(
                    f"moving a sharded model ({sp.local.device} -> {moved.device}, e.g. "
                    "model.to(device), .cpu()) after shardkit.shard() is not supported: the "
                    "engine's devices were fixed at shard(). HINT: pass device_id= to shard() "
                    "for the compute device, or cpu_offload=True to keep the shards on the host")
        # torch would swap a DTensor parameter's contents (swap_tensors), which the weak
        # references shardkit keeps to it forbid; `fn` changes nothing there (checked above, and
        # already applied to the rows it views), so the sharded parameters sit the call out.
        away = [(module, name, sp.sharded) for sp in params
                for module, name in sp.owners if module._parameters.get(name) is sp.sharded]
        for module, name, _ in away:
            module._parameters[name] = None
        try:
            return super()._apply(fn, recurse)  # type: ignore[misc]
        finally:
            for module, name, param in away:
                module._parameters[name] = param

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """Refuse with a hint: the parameters are this rank's shards, tied to live process groups."""
        raise ShardkitError(
            f"copy.deepcopy of a sharded {type(self).__name__.removeprefix('Sharded')} is not "
            "supported: its parameters are this rank's shards and its engine state holds process "
            "groups. HINT: "
            "deepcopy the model before shardkit.shard(), or build a fresh model and load "
            "shardkit.checkpoint.full_state_dict(model) into it")

    @contextlib.contextmanager
    def unshard(self, writeback: bool = False) -> Iterator[Any]:
        """Gather every parameter once and keep the full weights until exit (eval, generation).

        With writeback=True, changes made to the full parameters are copied back into the shards.
        """
        state = get_state(self)
        state.keep_unsharded += 1
        try:
            for unit in state.units:
                unit.unshard(async_op=True)
            for unit in state.units:
                unit.to_unsharded()
            yield self
        finally:
            state.keep_unsharded -= 1
            if state.keep_unsharded == 0:
                for unit in state.units:
                    if writeback and unit.is_unsharded:
                        for p in unit.params:
                            p.load_full(p.unsharded.detach().to(p.master_dtype))
                    unit.to_sharded()


def _set_custom_comm(state: ShardState, kind: str, comm: Any) -> None:
    """Check that `comm` can serve this model's `kind` collectives, then give every unit its strategies."""
    setter = f"set_custom_{kind}"
    if comm is not None:
        check_custom_comm(comm, kind.replace("_", "-"), takes_op=kind == "reduce_scatter")
        backend = state.backend
        if not backend.capabilities.torch_process_group:
            raise ShardkitError(
                f"{setter}() needs collectives on torch process groups (the comm is called with "
                f"a torch.distributed ProcessGroup), and backend {backend.name!r} does not run "
                "them (Capabilities.torch_process_group is False). HINT: keep the built-in "
                "collectives on this backend")
        quant = state.config.quantization
        if quant.weights if kind == "all_gather" else quant.gradients:
            what = "weights" if kind == "all_gather" else "gradients"
            raise ShardkitError(
                f"{setter}() on a model sharded with Quantization({what}=True): the quantized "
                f"{kind.replace('_', '-')} is itself the collective a custom one would replace. "
                f"HINT: shard with Quantization({what}=False) to run your own comm, or drop it")
    if state.reductions or any(u.in_flight or u.needs_post_backward for u in state.units):
        raise ShardkitError(
            f"{setter}() during a step (a gather or a backward's reduction is in flight): the "
            "unit's collectives would change halfway. HINT: call it between steps (after "
            "optimizer.step(), or before the first forward)")
    setattr(state, f"custom_{kind}", comm)
    for unit in state.units:
        unit.collectives = unit.choose_collectives()


def _find_unit(state: ShardState, key: object) -> ShardUnit:
    for unit in state.units:
        if key is unit.module or key == unit.name or (key == "" and unit is state.root_unit):
            return unit
    what = f"module {type(key).__name__}" if isinstance(key, nn.Module) else repr(key)
    raise ShardkitError(f"{what} is not a sharding unit of this model; HINT: pass one of the units' "
                        f"modules or names: {[u.name for u in state.units]}")


def _find_units(state: ShardState, keys: Sequence[nn.Module | str]) -> list[ShardUnit]:
    if isinstance(keys, (nn.Module, str)):
        raise ShardkitError("the units to prefetch must be a list (of modules or unit names), got a "
                            f"single {type(keys).__name__}; HINT: wrap it in a list")
    return [_find_unit(state, k) for k in keys]


def _save_pretrained_refused(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Refused at once: Hugging Face's save_pretrained() of a sharded model hangs or fails."""
    # Called on rank 0 alone (the habit), transformers' tied-weights check ran a collective on
    # the DTensor parameters that no other rank joined: a hang until the collective timeout,
    # a folder with config.json and no weights. Called on every rank, safetensors refused the
    # DTensors' storage. export() is collective and writes what from_pretrained() reads.
    if get_state(self).shard_group.size == 1:
        # Every rank holds whole parameters (Replicate DTensors): Hugging Face's own save works
        # on their local tensors (safetensors reads a storage, which a DTensor has not).
        given = kwargs.get("state_dict")
        kwargs["state_dict"] = {name: local_of(value) for name, value in
                                (self.state_dict() if given is None else given).items()}
        return super(type(self), self).save_pretrained(*args, **kwargs)  # type: ignore[misc]
    raise ShardkitError(
        "save_pretrained() of a model sharded by shardkit would write one rank's rows (or wait "
        "for ranks that never join it). HINT: call shardkit.checkpoint.export(dir, model) on "
        "every rank (rank 0 writes the safetensors files, their index when split, and "
        "config.json); from_pretrained(dir) then loads it as it is")


def sharded_class(cls: type) -> type:
    """Return the class shard() gives a model of class `cls` (ShardedModule in front), made once per class."""
    with _CLASSES_LOCK:
        ref = _SHARDED_CLASSES.get(cls)
        sub = None if ref is None else ref()
        if sub is None:
            members = {}
            if callable(getattr(cls, "save_pretrained", None)):
                members["save_pretrained"] = _save_pretrained_refused
            sub = type(f"Sharded{cls.__name__}", (ShardedModule, cls), members)
            _SHARDED_CLASSES[cls] = weakref.ref(sub)
        return sub
