"""Which submodules become sharding units, and per-layer recipes that compose with them.

The public face of two engine modules: the auto-wrap policies (`size_based`,
`transformer_layers`, `module_list`, any callable(module) -> bool; sharding/wrap_policies.py)
and the per-layer recipes (`compile_layers`, `checkpoint_layers`; sharding/surface/recipes.py, beside
the hooks they drive).
"""

from __future__ import annotations

from .sharding.surface.recipes import checkpoint_layers, compile_layers
from .sharding.wrap_policies import (ModuleListItems, SizeBased, TransformerLayers, WrapPolicy, as_policy, module_list, size_based, transformer_layers)

__all__ = ["ModuleListItems", "SizeBased", "TransformerLayers", "WrapPolicy", "as_policy",
           "checkpoint_layers", "compile_layers", "module_list", "size_based", "transformer_layers"]
