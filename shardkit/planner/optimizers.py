"""How many parameter-sized state tensors each optimizer keeps (shared by the planner and the demo)."""

from __future__ import annotations

from ..errors import ShardkitError

# Tensors of optimizer state each trainable parameter carries, in the parameter's dtype; step
# counters are scalars and do not count.
STATE_TENSORS_PER_PARAM = {"adamw": 2, "adam": 2, "adadelta": 2, "sgd": 0}


def state_tensors(optimizer: str) -> int:
    """Number of parameter-sized state tensors `optimizer` (a name, any case) keeps per parameter."""
    key = optimizer.lower() if isinstance(optimizer, str) else optimizer
    if key not in STATE_TENSORS_PER_PARAM:
        raise ShardkitError(f"unknown optimizer {optimizer!r}; choose one of "
                            f"{', '.join(sorted(STATE_TENSORS_PER_PARAM))}")
    return STATE_TENSORS_PER_PARAM[key]
