"""Methods a sharded model gains: no_sync(), unshard(), and access to its engine state."""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn

from ..errors import ShardkitError
from .state import ShardState

STATE_ATTR = "_shardkit_state"


def get_state(module: nn.Module) -> ShardState:
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

    @contextlib.contextmanager
    def unshard(self, writeback: bool = False) -> Iterator[nn.Module]:
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
