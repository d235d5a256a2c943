"""Methods a sharded model gains: no_sync(), unshard(), a clear deepcopy error, and access to its engine state."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

from ..errors import ShardkitError
from .state import ShardState

STATE_ATTR = "_shardkit_state"
# original class -> its Sharded subclass: one class per model class, however many models shard()
_SHARDED_CLASSES: dict[type, type] = {}
_CLASSES_LOCK = threading.Lock()


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


def sharded_class(cls: type) -> type:
    """Return the class shard() gives a model of class `cls` (ShardedModule in front), made once per class."""
    with _CLASSES_LOCK:
        if cls not in _SHARDED_CLASSES:
            _SHARDED_CLASSES[cls] = type(f"Sharded{cls.__name__}", (ShardedModule, cls), {})
        return _SHARDED_CLASSES[cls]
