"""Per-layer recipes that compose with the units: torch.compile per layer, activation
checkpointing per layer (users reach them as `shardkit.wrap.compile_layers` / `checkpoint_layers`).

They live beside what they drive: compile_layers compiles a unit through the engine's hooks
(hooks.compile_unit), so the gather and the reduce stay outside the compiled region.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable

import torch
from torch import nn

from ...errors import ShardkitError
from ..step.hooks import compile_unit, unit_of
from ..wrap_policies import TransformerLayers


def _instances(model: nn.Module, classes: Iterable[type] | type, what: str) -> list[nn.Module]:
    classes = TransformerLayers(classes).classes  # validates: nn.Module subclasses only
    found = [m for m in model.modules() if isinstance(m, classes)]
    if not found:
        names = ", ".join(c.__name__ for c in classes)
        raise ShardkitError(f"{what}: the model has no instance of {names}; HINT: pass the class "
                            f"of the repeated layer, e.g. {{type(model.layers[0])}}")
    return found


def compile_layers(model: nn.Module, classes: Iterable[type] | type,
                   **compile_kwargs) -> list[nn.Module]:
    """torch.compile the forward of every instance of `classes` (the engine's hooks stay eager).

    Call it after shardkit.shard() with the classes that are units (as torchtitan compiles each
    block): the gather before and the reduce after a layer run in the module hooks, outside the
    compiled region, so the compiled graph sees plain full-shape parameters and does not
    recompile between steps. Returns the modules compiled.
    """
    layers = _instances(model, classes, "compile_layers")
    for layer in layers:
        unit = unit_of(layer)
        if unit is not None:  # the device's compile backend where it needs one
            compile_unit(unit, **compile_kwargs)
        else:
            layer.forward = torch.compile(layer.forward, **compile_kwargs)
    return layers


def _checkpointed(forward: Callable, *args, **kwargs):
    from torch.utils.checkpoint import checkpoint

    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpoint_layers(model: nn.Module, classes: Iterable[type] | type) -> list[nn.Module]:
    """Recompute every instance of `classes` in backward instead of saving its activations.

    Non-reentrant torch.utils.checkpoint around each layer's forward. Use it on units (or
    modules inside one unit), not on a module that contains other units: the engine exposes a
    unit's gathered parameters again before its backward, which is when the recomputation reads
    them. Works before or after shardkit.shard(). Returns the modules wrapped.
    """
    layers = _instances(model, classes, "checkpoint_layers")
    for layer in layers:
        layer.forward = functools.partial(_checkpointed, layer.forward)
    return layers
