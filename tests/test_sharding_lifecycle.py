"""The unit lifecycle tables: the moves the engine makes are allowed, the others refused."""

from __future__ import annotations

import pytest

from shardkit.errors import ShardkitError
from shardkit.sharding.step.lifecycle import (SHARDED_MOVES, TRAINING_MOVES, ShardedState,
                                         TrainingState, advance)

S, T = ShardedState, TrainingState


@pytest.mark.parametrize("path", [
    [S.SHARDED, S.GATHERING, S.UNSHARDED, S.SHARDED],  # FULL_SHARD forward, prefetched
    [S.SHARDED, S.UNSHARDED, S.KEPT, S.UNSHARDED, S.SHARDED],  # SHARD_GRAD_OP forward + backward
    [S.SHARDED, S.GATHERING, S.SHARDED],  # an unused prefetch dropped
    # reshard_after_forward=k: a 1/k slice kept, gathered over k ranks in backward
    [S.SHARDED, S.GATHERING, S.UNSHARDED, S.PARTIAL, S.GATHERING, S.UNSHARDED, S.SHARDED],
    [S.SHARDED, S.UNSHARDED, S.PARTIAL, S.SHARDED],  # a no-grad forward's slice dropped
])
def test_engine_paths_are_allowed(path):
    state = path[0]
    for nxt in path[1:]:
        state = advance("u", state, nxt, SHARDED_MOVES)
    assert state is path[-1]


@pytest.mark.parametrize("current,new", [(S.SHARDED, S.KEPT), (S.GATHERING, S.KEPT),
                                         (S.UNSHARDED, S.GATHERING), (S.KEPT, S.GATHERING),
                                         (S.SHARDED, S.PARTIAL), (S.KEPT, S.PARTIAL),
                                         (S.PARTIAL, S.UNSHARDED), (S.PARTIAL, S.KEPT)])
def test_impossible_sharded_moves_raise(current, new):
    with pytest.raises(ShardkitError, match=f"unit 'blk' cannot go from {current.name} to {new.name}"):
        advance("blk", current, new, SHARDED_MOVES)


def test_training_moves():
    state = T.IDLE
    for nxt in (T.FORWARD, T.PRE_BACKWARD, T.POST_BACKWARD, T.IDLE):
        state = advance("u", state, nxt, TRAINING_MOVES)
    assert advance("u", T.FORWARD, T.FORWARD, TRAINING_MOVES) is T.FORWARD  # staying put
    with pytest.raises(ShardkitError):
        advance("u", T.IDLE, T.PRE_BACKWARD, TRAINING_MOVES)  # backward due without a forward
    with pytest.raises(ShardkitError):
        advance("u", T.PRE_BACKWARD, T.FORWARD, TRAINING_MOVES)
