"""Casting a call's floating-point tensors: MixedPrecision's inputs and outputs, eager or traced."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map


def cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """`tree` with every floating-point tensor of another dtype cast to `dtype`."""
    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and torch.is_floating_point(x) and x.dtype != dtype:
            return x.to(dtype)
        return x
    return tree_map(cast, tree)


def cast_inputs(args: tuple, kwargs: dict, dtype: torch.dtype) -> tuple[tuple, dict]:
    """The floating-point tensors among a call's arguments cast to `dtype`."""
    return cast_floats(args, dtype), cast_floats(kwargs, dtype)
