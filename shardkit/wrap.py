"""Auto-wrap policies (which submodules become their own sharding unit), and per-layer helpers
that compose with them: torch.compile per layer and activation checkpointing per layer.

A policy is any callable `policy(module) -> bool`. The classes below also look at where the module
sits (its parent) and how many parameters nested units have not already claimed, which is why the
engine calls `should_wrap(module, parent=..., unclaimed_numel=...)` when a policy defines it.
Modules are visited bottom-up; the root module is always a unit and claims what nobody else did.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable

import torch
from torch import nn
from typing_extensions import override

from .errors import ShardkitError


class WrapPolicy:
    """Base class: decide whether `module` becomes a unit."""

    def should_wrap(self, module: nn.Module, *, parent: nn.Module | None,
                    unclaimed_numel: int) -> bool:
        """Return True to make `module` (with `unclaimed_numel` params not in nested units) a unit."""
        raise NotImplementedError

    def __call__(self, module: nn.Module) -> bool:
        """Plain-callable form (no parent, all params counted)."""
        return self.should_wrap(module, parent=None,
                                unclaimed_numel=sum(p.numel() for p in module.parameters()))


class SizeBased(WrapPolicy):
    """Wrap every module whose not-yet-claimed parameters number at least `min_num_params`."""

    def __init__(self, min_num_params: int) -> None:
        if not isinstance(min_num_params, int) or min_num_params < 1:
            raise ShardkitError(f"size_based needs a positive int min_num_params, got {min_num_params!r}")
        self.min_num_params = min_num_params

    @override
    def should_wrap(self, module, *, parent, unclaimed_numel):
        """Wrap when enough unclaimed parameters have accumulated in this subtree."""
        return unclaimed_numel >= self.min_num_params

    @override
    def __repr__(self) -> str:
        return f"size_based({self.min_num_params})"


class TransformerLayers(WrapPolicy):
    """Wrap every instance of the given layer classes (e.g. a transformer block)."""

    def __init__(self, classes: Iterable[type] | type) -> None:
        classes = tuple(classes) if not isinstance(classes, type) else (classes,)
        bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if not classes or bad:
            raise ShardkitError(f"transformer_layers needs nn.Module subclasses, got {bad or classes!r}")
        self.classes = classes

    @override
    def should_wrap(self, module, *, parent, unclaimed_numel):
        """Wrap instances of the configured classes."""
        return isinstance(module, self.classes)

    @override
    def __repr__(self) -> str:
        return f"transformer_layers({{{', '.join(c.__name__ for c in self.classes)}}})"


class ModuleListItems(WrapPolicy):
    """Wrap every element of every nn.ModuleList (the usual list of layers)."""

    @override
    def should_wrap(self, module, *, parent, unclaimed_numel):
        """Wrap modules whose parent is an nn.ModuleList."""
        return isinstance(parent, nn.ModuleList)

    @override
    def __repr__(self) -> str:
        return "module_list()"


class _Callable(WrapPolicy):
    def __init__(self, fn: Callable[[nn.Module], bool]) -> None:
        self.fn = fn

    @override
    def should_wrap(self, module, *, parent, unclaimed_numel):
        """Ask the user's callable."""
        return bool(self.fn(module))


def size_based(min_num_params: int) -> WrapPolicy:
    """Policy: a unit for each subtree holding at least `min_num_params` unclaimed parameters."""
    return SizeBased(min_num_params)


def transformer_layers(classes: Iterable[type] | type) -> WrapPolicy:
    """Policy: a unit for every instance of the given module classes."""
    return TransformerLayers(classes)


def module_list() -> WrapPolicy:
    """Policy: a unit for every element of every nn.ModuleList."""
    return ModuleListItems()


def as_policy(policy: WrapPolicy | Callable[[nn.Module], bool] | None) -> WrapPolicy | None:
    """Turn None, a WrapPolicy or any callable(module) -> bool into a WrapPolicy (or None)."""
    if policy is None or isinstance(policy, WrapPolicy):
        return policy
    if callable(policy):
        return _Callable(policy)
    raise ShardkitError(f"auto_wrap_policy must be a shardkit.wrap policy or a callable(module) -> "
                        f"bool, got {type(policy).__name__}")


def _instances(model: nn.Module, classes: Iterable[type] | type, what: str) -> list[nn.Module]:
    classes = TransformerLayers(classes).classes  # validates: nn.Module subclasses only
    found = [m for m in model.modules() if isinstance(m, classes)]
    if not found:
        names = ", ".join(c.__name__ for c in classes)
        raise ShardkitError(f"{what}: the model has no instance of {names}; HINT: pass the class "
                            f"of the repeated layer, e.g. {{type(model.layers[0])}}")
    return found


def compile_layers(model: nn.Module, classes: Iterable[type] | type,
                   **compile_kwargs) -> list[nn.Module]:
    """torch.compile the forward of every instance of `classes` (the engine's hooks stay eager).

    Call it after shardkit.shard() with the classes that are units (as torchtitan compiles each
    block): the gather before and the reduce after a layer run in the module hooks, outside the
    compiled region, so the compiled graph sees plain full-shape parameters and does not
    recompile between steps. Returns the modules compiled.
    """
    from .sharding.hooks import compile_unit, unit_of

    layers = _instances(model, classes, "compile_layers")
    for layer in layers:
        unit = unit_of(layer)
        if unit is not None:  # the device's compile backend where it needs one
            compile_unit(unit, **compile_kwargs)
        else:
            layer.forward = torch.compile(layer.forward, **compile_kwargs)
    return layers


def _checkpointed(forward: Callable, *args, **kwargs):
    from torch.utils.checkpoint import checkpoint

    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpoint_layers(model: nn.Module, classes: Iterable[type] | type) -> list[nn.Module]:
    """Recompute every instance of `classes` in backward instead of saving its activations.

    Non-reentrant torch.utils.checkpoint around each layer's forward. Use it on units (or
    modules inside one unit), not on a module that contains other units: the engine exposes a
    unit's gathered parameters again before its backward, which is when the recomputation reads
    them. Works before or after shardkit.shard(). Returns the modules wrapped.
    """
    layers = _instances(model, classes, "checkpoint_layers")
    for layer in layers:
        layer.forward = functools.partial(_checkpointed, layer.forward)
    return layers


__all__ = ["WrapPolicy", "as_policy", "checkpoint_layers", "compile_layers", "module_list",
           "size_based", "transformer_layers"]
