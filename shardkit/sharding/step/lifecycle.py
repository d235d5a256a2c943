"""A unit's lifecycle as two small state machines (as FSDP2's ShardedState / TrainingState).

ShardedState says where the unit's parameter values live and which tensors its modules expose;
TrainingState says where the unit is in a forward/backward pass. Every change goes through
`advance`, which refuses transitions the engine never makes, so a bookkeeping slip fails loudly
at the step where it happens instead of as wrong numbers later.
"""

from __future__ import annotations

from enum import Enum
from typing import TypeVar

from ...errors import ShardkitError


class ShardedState(Enum):
    """Where a unit's parameters are, and what its modules expose."""

    SHARDED = "sharded"  # only the shards exist; modules expose the shards
    GATHERING = "gathering"  # an all-gather is in flight; modules expose the shards
    UNSHARDED = "unsharded"  # gathered; modules expose the full (compute) parameters
    KEPT = "kept"  # gathered and kept for backward (SHARD_GRAD_OP); modules expose the shards
    # Resharded to k ranks (reshard_after_forward=k): a 1/k slice of the gathered values kept
    # for backward, which gathers inside the k-rank group; modules expose the shards.
    PARTIAL = "partial"


class TrainingState(Enum):
    """Where a unit is in the current forward/backward pass."""

    IDLE = "idle"  # no backward due
    FORWARD = "forward"  # a forward with grad ran; its backward (and reduction) is due
    PRE_BACKWARD = "pre_backward"  # backward reached the unit; its reduction is due
    POST_BACKWARD = "post_backward"  # backward reached the unit; nothing left to reduce this pass


_State = TypeVar("_State", ShardedState, TrainingState)
S, T = ShardedState, TrainingState
SHARDED_MOVES = {
    S.SHARDED: {S.GATHERING, S.UNSHARDED},
    S.GATHERING: {S.UNSHARDED, S.SHARDED},
    S.UNSHARDED: {S.SHARDED, S.KEPT, S.PARTIAL},
    S.KEPT: {S.UNSHARDED, S.SHARDED},
    S.PARTIAL: {S.GATHERING, S.SHARDED},
}
TRAINING_MOVES = {
    T.IDLE: {T.FORWARD, T.POST_BACKWARD, T.IDLE},
    T.FORWARD: {T.PRE_BACKWARD, T.POST_BACKWARD, T.IDLE},
    # A forward inside backward (a reentrant recomputation) makes the reduction due again.
    T.PRE_BACKWARD: {T.POST_BACKWARD, T.IDLE},
    T.POST_BACKWARD: {T.PRE_BACKWARD, T.IDLE},
}


def advance(name: str, current: _State, new: _State, moves: dict) -> _State:
    """Return `new` if the move from `current` is allowed (staying put always is), else raise."""
    if new is not current and new not in moves[current]:
        raise ShardkitError(f"internal error: unit {name!r} cannot go from {current.name} to "
                            f"{new.name}; please report this with the model and the call order")
    return new
