"""Auto-wrap policies: which submodules become their own sharding unit (shard() asks, plan.py applies).

A policy is any callable `policy(module) -> bool`. The classes below also look at where the module
sits (its parent) and how many parameters nested units have not already claimed, which is why the
engine calls `should_wrap(module, parent=..., unclaimed_numel=...)` when a policy defines it.
Modules are visited bottom-up; the root module is always a unit and claims what nobody else did.
Users reach them as `shardkit.wrap.*`.
"""

from __future__ import annotations

from typing import Callable, Iterable

from torch import nn
from typing_extensions import override

from ..errors import ShardkitError


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
