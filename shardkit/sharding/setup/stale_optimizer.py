"""Catch an optimizer built before shard(): on its first step, say so instead of training nothing.

shard() replaces every parameter with this rank's shard, so an optimizer made earlier holds the
old full tensors: they never get a gradient, and torch's optimizers silently skip them. A global
optimizer step pre-hook checks each optimizer once (its first step) against the replaced
parameters; once it passed, later steps cost one dictionary lookup. It also records the "optimizer step" phase
for failure reports, and hands a checked optimizer to surface/local_step.py (its later steps run on
the DTensor parameters' local tensors where that computes the same numbers).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

from ...errors import ShardkitError
from ...failure import where
from ..surface import local_step
from .plan import ParamPlan

# id(original parameter) -> (weak reference to it, its name); ids are checked against the
# reference, so a recycled id never matches.
_replaced: dict[int, tuple[weakref.ref, str]] = {}
_checked: "weakref.WeakKeyDictionary[torch.optim.Optimizer, bool]" = weakref.WeakKeyDictionary()
_hook: Any = None


def _forget(key: int) -> Callable[[Any], None]:
    # The id of a collected parameter may be reused by a new one: drop it with the parameter.
    def drop(_ref: Any) -> None:
        _replaced.pop(key, None)
    return drop


def remember_replaced(plans: list[ParamPlan]) -> None:
    """Record the parameters shard() is about to replace, and install the step check once."""
    global _hook
    for plan in plans:
        key = id(plan.param)
        _replaced[key] = (weakref.ref(plan.param, _forget(key)), plan.fqns[0])
    if _hook is None:
        _hook = (register_optimizer_step_pre_hook(_before_step),
                 register_optimizer_step_post_hook(_after_step))


def uninstall() -> None:
    """Remove the step hooks and forget every entry (shutdown(), process_state.reset)."""
    global _hook
    hooks, _hook = _hook, None
    for handle in hooks or ():
        handle.remove()
    _replaced.clear()
    _checked.clear()


def _after_step(*_: Any) -> None:
    where.enter(None, "between optimizer step and forward")


def stale_names(optimizer: torch.optim.Optimizer) -> list[str]:
    """Names of the replaced (pre-shard) parameters that `optimizer` holds."""
    names = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = _replaced.get(id(p))
            if entry is not None and entry[0]() is p:
                names.append(entry[1])
    return names


def _before_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    where.enter(None, "optimizer step")
    if optimizer in _checked:
        return
    names = stale_names(optimizer)
    if not names:
        _checked[optimizer] = True  # clean: later steps skip the check
        local_step.adopt(optimizer)  # later steps of an elementwise one run on local tensors
    else:
        shown = ", ".join(repr(n) for n in names[:3]) + (", ..." if len(names) > 3 else "")
        raise ShardkitError(
            f"{type(optimizer).__name__} was built before shardkit.shard(): it holds {len(names)} "
            f"parameter(s) the model no longer uses ({shown}), so stepping it would train "
            "nothing. HINT: create the optimizer after shard(), from the sharded model: "
            "opt = torch.optim.AdamW(model.parameters(), ...)")

