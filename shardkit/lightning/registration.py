"""Put "shardkit" in Lightning's strategy registries when Lightning is imported, without importing it.

Lightning resolves `Trainer(strategy="shardkit")` from `lightning.pytorch.strategies.
StrategyRegistry` (and Fabric from `lightning.fabric.strategies.STRATEGY_REGISTRY`) while the
Trainer is being built, and reads no entry point for strategies (its
only entry-point group, `lightning.pytorch.callbacks_factory`, is read after the strategy is
chosen). So `import shardkit` installs import hooks that register the strategies right after
Lightning's strategies modules have run, or at once if they already have; Lightning itself is never
imported by shardkit (it takes seconds, and most users of shardkit never use it).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any, Callable

from typing_extensions import override

TRAINER_STRATEGIES = "lightning.pytorch.strategies"
FABRIC_STRATEGIES = "lightning.fabric.strategies"


def register_trainer_strategy(strategies: ModuleType) -> None:
    """Register ShardkitStrategy in the Trainer's strategy registry (in `strategies`)."""
    if _still_importing(__package__ + ".strategy"):
        return  # strategy.py is what imported Lightning: it registers itself once it has run
    from .strategy import ShardkitStrategy

    ShardkitStrategy.register_strategies(strategies.StrategyRegistry)


def register_fabric_strategy(strategies: ModuleType) -> None:
    """Register ShardkitFabricStrategy in Fabric's strategy registry (in `strategies`)."""
    if _still_importing(__package__ + ".fabric"):
        return  # fabric.py is what imported Lightning: it registers itself once it has run
    from .fabric import ShardkitFabricStrategy

    ShardkitFabricStrategy.register_strategies(strategies.STRATEGY_REGISTRY)


def _still_importing(name: str) -> bool:
    """True while module `name` runs its own imports: `from shardkit.lightning import
    ShardkitStrategy` in a fresh process imports Lightning from inside strategy.py, whose class
    does not exist yet when Lightning's strategies module finishes and the hook fires."""
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    return module is not None and bool(getattr(spec, "_initializing", False))


# module Lightning registers its strategies in -> (the registry's name there, how to register)
_WATCHED = {TRAINER_STRATEGIES: ("StrategyRegistry", register_trainer_strategy),
            FABRIC_STRATEGIES: ("STRATEGY_REGISTRY", register_fabric_strategy)}


class _RunAfter(importlib.abc.Loader):
    """A module's own loader, then `then(module)` once the module has run."""

    def __init__(self, loader: Any, then: Callable[[ModuleType], None]) -> None:
        self._loader, self._then = loader, then

    @override
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    @override
    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._then(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, ... for tools that ask
        return getattr(self._loader, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of the one module it watches."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name, self.then = name, then

    @override
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _RunAfter(spec.loader, self.then)
                return spec
        return None


def install() -> None:
    """Register now where Lightning's strategies are loaded, else when they are (idempotent)."""
    for name, (registry, register) in _WATCHED.items():
        loaded = sys.modules.get(name)
        if loaded is not None and hasattr(loaded, registry):
            register(loaded)
        elif not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
            sys.meta_path.insert(0, _AfterImport(name, register))
