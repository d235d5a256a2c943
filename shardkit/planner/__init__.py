"""Plan before you launch: per-rank memory and bytes sent per step, predicted from shapes alone.

Layout: build (`plan()`: units from the engine's plan_units, padding from its shard_layout, bytes
recorded into its CommStats), result (the frozen `Plan` / `UnitRow` and their text table and
JSON form), optimizers (state tensors per parameter), models (building a model on the meta
device from a `module:factory` or a transformers config), cli (`shardkit plan`).
"""

from .build import plan
from .result import Plan, UnitRow

__all__ = ["Plan", "UnitRow", "plan"]
