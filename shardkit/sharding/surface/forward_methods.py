"""register_forward_method(): run a method other than forward (generate, encode) under a unit's hooks."""

from __future__ import annotations

import functools
from typing import Any

from torch import nn

from ...errors import ShardkitError
from ..step.hooks import eager_post_forward, eager_pre_forward, unit_of

_WRAPPED = "__shardkit_forward_method__"


def register_forward_method(module: nn.Module, method_name: str) -> None:
    """Make `module.method_name(...)` run the unit's pre- and post-forward hooks around it, as forward does.

    Its parameters are gathered (and mixed-precision casts applied) for the call and resharded
    after, so a method that uses the unit's layers directly, not through forward, sees full
    weights; the unit's forward (or another registered method) called inside it runs without
    the hooks a second time. `module` is the model shard() returned or a module auto_wrap_policy made a unit.
    """
    unit = unit_of(module)
    if unit is None:
        raise ShardkitError(
            f"register_forward_method: {type(module).__name__} is not a sharding unit. HINT: pass "
            "the model returned by shardkit.shard(), or a submodule that auto_wrap_policy= made a "
            "unit")
    method = getattr(module, method_name, None)
    if not callable(method):
        raise ShardkitError(f"register_forward_method: {type(module).__name__} has no method "
                            f"{method_name!r}")
    if method_name == "forward" or getattr(method, _WRAPPED, False):
        return  # forward runs the hooks already; registering twice would nest them

    @functools.wraps(method)
    def run_under_hooks(*args: Any, **kwargs: Any) -> Any:
        if unit.in_forward_method:  # called from another registered method: gathered already
            return method(*args, **kwargs)
        args, kwargs = eager_pre_forward(unit, module, args, kwargs)
        unit.in_forward_method += 1
        try:
            output = method(*args, **kwargs)
        finally:
            unit.in_forward_method -= 1
        return eager_post_forward(unit, module, args, kwargs, output)

    setattr(run_under_hooks, _WRAPPED, True)
    # An instance attribute: the class (shared by every model of that type) stays untouched.
    module.__dict__[method_name] = run_under_hooks
