"""The optimizer of a fault-tolerant model: zero_grad() joins the step's quorum, step() commits or skips it.

torchft's contract is two calls per step: start a quorum before the forward (so it forms while the
model computes) and vote on committing after the backward. Tying them to the two optimizer calls
every training loop already makes keeps the loop the user wrote; the wrapper is still the
optimizer (an LR scheduler or clip_grad_norm_ takes it as one).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from typing_extensions import override

from ..errors import ShardkitError


class FaultTolerantOptimizer(torch.optim.Optimizer):
    """`optimizer`, stepping only on steps every replica group in the quorum finished."""

    def __init__(self, optimizer: torch.optim.Optimizer, cross_groups: Any) -> None:
        # Not Optimizer.__init__: the wrapped optimizer owns param_groups and state; these
        # attributes forward to it so schedulers and checkpoints see the one optimizer.
        self.optimizer = optimizer
        self.cross_groups = cross_groups
        self.committed: bool | None = None  # the last step's outcome (None before the first)
        self.defaults = optimizer.defaults

    @property  # type: ignore[explicit-override]  # mypy takes no @override on a settable property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property  # type: ignore[explicit-override]  # mypy takes no @override on a settable property
    def state(self) -> Any:
        """The wrapped optimizer's per-parameter state."""
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @override
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Join this step's quorum (it forms during the forward), then clear the gradients."""
        self.cross_groups.start_quorum()
        self.optimizer.zero_grad(set_to_none)

    @override
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Step the wrapped optimizer if every group committed this step; else leave the weights."""
        if closure is not None:
            raise ShardkitError("a fault-tolerant step cannot re-run a closure (the vote is once "
                                "per step); HINT: compute the loss and backward before step()")
        if not self.cross_groups.quorum_started:
            raise ShardkitError("optimizer.step() without optimizer.zero_grad() first: the "
                                "fault-tolerant optimizer joins each step's quorum in zero_grad()."
                                " HINT: call optimizer.zero_grad() at the start of every step")
        self.committed = self.cross_groups.should_commit()
        if self.committed:
            self.optimizer.step()

    @property
    def wrapped_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer this one steps (checkpoints record its class: they load with or without the wrapper)."""
        return self.optimizer

    @override
    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state_dict."""
        return self.optimizer.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the wrapped optimizer."""
        self.optimizer.load_state_dict(state_dict)

    @override
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add to the wrapped optimizer."""
        self.optimizer.add_param_group(param_group)

    def register_state(self, key: str, load: Callable[[Any], None], save: Callable[[], Any]) -> None:
        """Also send `save()` to a recovering group and `load` it there (an LR scheduler's state)."""
        self.cross_groups.register_state(key, load, save)

    @property
    def current_step(self) -> int:
        """Steps committed by the replica groups so far (a recovered group jumps to the others')."""
        return int(self.cross_groups.manager.current_step())

    @property
    def participating_groups(self) -> int:
        """How many replica groups took part in the last quorum."""
        return int(self.cross_groups.manager.num_participants())

    @property
    def batches_committed(self) -> int:
        """Group-batches committed so far: the sum over committed steps of the groups taking part."""
        return int(self.cross_groups.manager.batches_committed())

    @override
    def __repr__(self) -> str:
        return f"FaultTolerantOptimizer({self.optimizer!r})"


def wrap(cross: Any, optimizer: torch.optim.Optimizer) -> FaultTolerantOptimizer:
    """`optimizer` made fault tolerant on a model's CrossGroups (its state is sent to a rejoining group)."""
    import weakref

    if isinstance(optimizer, FaultTolerantOptimizer):
        raise ShardkitError("this optimizer is already fault tolerant; wrap the plain one once")
    if "optimizer" in cross.registered:
        raise ShardkitError("this model already has a fault-tolerant optimizer; a recovering "
                            "group is sent one optimizer's state. HINT: put every parameter "
                            "group in one optimizer")
    ref = weakref.ref(optimizer)

    def save() -> Any:
        opt = ref()
        return opt.state_dict() if opt is not None else {}

    def load(received: Any) -> None:
        opt = ref()
        if opt is not None:
            opt.load_state_dict(received)

    cross.register_state("optimizer", load, save)
    return FaultTolerantOptimizer(optimizer, cross)
