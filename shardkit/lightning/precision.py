"""Lightning's precision flags as shardkit settings, and gradient clipping that sees every shard.

Pure decisions first (tested without Lightning running): which `precision=` strings shardkit can
honour and with which MixedPrecision. Lightning keeps building its own precision plugin (the
autocast of "bf16-mixed", the module conversion of "bf16-true"); shardkit adds the sharded side.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ..errors import ShardkitError
from ..sharding.policies import MixedPrecision

SUPPORTED = ("32-true", "bf16-mixed", "bf16-true", "16-true", "64-true")


def mixed_precision_for(precision: str) -> MixedPrecision | None:
    """The MixedPrecision a Lightning precision flag means for shardkit (None: params as they are).

    "bf16-mixed": bf16 all-gathers and compute, fp32 shards (the master weights) and fp32
    gradient reduction, under Lightning's bf16 autocast; the "-true" flags convert the whole
    module first, so its shards are already in that dtype and nothing is cast.
    """
    if precision == "bf16-mixed":
        return MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision in SUPPORTED:
        return None
    if precision == "16-mixed":
        raise ShardkitError(
            "precision='16-mixed' is not supported with strategy='shardkit': fp16 loss scaling "
            "would check for inf/NaN in this rank's shards only, and skip or keep a step "
            "differently on each rank. HINT: use precision='bf16-mixed' (no loss scaling "
            f"needed); supported: {', '.join(SUPPORTED)}")
    raise ShardkitError(f"precision={precision!r} is not supported with strategy='shardkit'; "
                        f"supported: {', '.join(SUPPORTED)}")


# plugin class -> weak reference to its clipping subclass; weak on both sides (the subclass
# refers to its base), so neither outlives the last plugin of them.
_SUBCLASSES: "weakref.WeakKeyDictionary[type, weakref.ref[type]]" = weakref.WeakKeyDictionary()


def forget_subclasses() -> None:
    """Forget the clipping subclasses made so far (process_state.reset)."""
    _SUBCLASSES.clear()


def clip_over_shards(plugin: Any, model: torch.nn.Module) -> None:
    """Make `plugin` clip by norm with shardkit.clip_grad_norm_ over `model` (in place).

    Lightning's plugins clip with torch.nn.utils.clip_grad_norm_ over the optimizer's
    parameters, which here are this rank's shards: each rank would take the norm of its own
    slice and scale by a different factor, silently. The plugin keeps its class (Lightning
    branches on isinstance) through a subclass that overrides only that method.
    """
    base = type(plugin)
    if not base.__dict__.get("_shardkit_clips_over_shards", False):
        ref = _SUBCLASSES.get(base)
        sub = None if ref is None else ref()
        if sub is None:
            sub = type(base.__name__, (base,), {
                "clip_grad_by_norm": _clip_grad_by_norm, "__module__": base.__module__,
                "_shardkit_clips_over_shards": True})
            _SUBCLASSES[base] = weakref.ref(sub)
        plugin.__class__ = sub
    plugin._shardkit_model = model


def _clip_grad_by_norm(self: Any, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
    from ..sharding.surface.clip import clip_grad_norm_

    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    model = self._shardkit_model
    if any(id(p) not in params for p in model.parameters() if p.requires_grad):
        raise ShardkitError(
            "gradient_clip_algorithm='norm' with strategy='shardkit' clips the whole model's "
            "gradients by their global norm, but this optimizer holds only some of its "
            "parameters. HINT: use one optimizer over model.parameters(), or clip by value")
    clip_grad_norm_(model, clip_val)
