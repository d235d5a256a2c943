"""Plan before you launch: per-rank memory and bytes sent per step, predicted from shapes alone.

Layout: build (`plan()`: units from the engine's plan_units, padding from its shard_layout, bytes
recorded into its CommStats), result (the frozen `Plan` / `UnitRow` and their text table and
JSON form), optimizers (state tensors per parameter), models (building a model on the meta
device from a `module:factory` or a transformers config), rehearsal (the real engine and
optimizer training two steps on a meta copy, under a backend that moves no bytes), activations
(the tracker that counts every storage there, attention as the target runs it), replay (a
rehearsed step as a timeline affine in the batch), workload (rehearsals kept per configuration),
fit (the largest batch / fewest ranks in a memory budget), measure (`--measure`: the planned
step trained here, planned vs measured), nodes (bytes across nodes), steptime, scale and
compute_times (step time at scale), recovery (what a rank recovering under fault tolerance
receives), tensor_parallel (`tp=`: torch's TP plan applied on a mesh of fake process groups,
its collectives counted as the rehearsed step issues them), cli (`shardkit plan`).
"""
from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .build import plan
    from .fit import Fit, fit_table, largest_batch, smallest_world_size
    from .result import Plan, UnitRow

# Imported on first use: the `shardkit plan` parser (and its --help) needs no torch.
_LAZY = {"plan": ".build", "Plan": ".result", "UnitRow": ".result", "Fit": ".fit",
         "fit_table": ".fit", "largest_batch": ".fit", "smallest_world_size": ".fit"}


def __getattr__(name: str) -> Any:
    """Resolve the public names lazily from their modules."""
    if name not in _LAZY:
        raise AttributeError(f"module 'shardkit.planner' has no attribute {name!r}")
    return getattr(import_module(_LAZY[name], __name__), name)


__all__ = ["Fit", "Plan", "UnitRow", "fit_table", "largest_batch", "plan", "smallest_world_size"]
