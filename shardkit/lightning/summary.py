"""Lightning's model summary on a sharded model: each parameter counted whole, not this rank's rows.

Lightning's ModelSummary callback sums `p.numel()`, which after shard() is this rank's rows: the
same model read 150 K at 2 devices and 100 K at 3 (issue 40). Lightning itself special-cases
DeepSpeed ZeRO-3 the same way; here the strategy points the Trainer's summary callbacks at a
summary that counts `shardkit.full_shape(p).numel()`.
"""

from __future__ import annotations

import functools
from typing import Any

from lightning.pytorch.callbacks import ModelSummary as SummaryCallback
from lightning.pytorch.utilities.model_summary.model_summary import (LayerSummary, ModelSummary,
                                                                      _tensor_has_shape)
from typing_extensions import override

from ..sharding.param_access import full_shape


def _whole_count(params: Any) -> int:
    return sum(full_shape(p).numel() for p in params if not _tensor_has_shape(p))


class WholeLayerSummary(LayerSummary):
    """A layer's row in the summary, its parameters counted whole."""

    @property
    @override
    def num_parameters(self) -> int:
        return _whole_count(self._module.parameters())


class WholeModelSummary(ModelSummary):
    """Lightning's ModelSummary with every sharded parameter counted at its full shape."""

    @override
    def summarize(self) -> dict[str, LayerSummary]:
        summary = super().summarize()
        for layer in summary.values():
            layer.__class__ = WholeLayerSummary  # same state; only the count differs
        return summary

    @property
    @override
    def total_parameters(self) -> int:
        return _whole_count(self._model.parameters())

    @property
    @override
    def trainable_parameters(self) -> int:
        return _whole_count(p for p in self._model.parameters() if p.requires_grad)


def count_whole_parameters(trainer: Any) -> None:
    """Make the Trainer's model-summary callbacks summarise the sharded model with whole counts."""
    for callback in trainer.callbacks:
        if isinstance(callback, SummaryCallback):
            callback._summary = functools.partial(_whole_summary, callback)  # type: ignore[method-assign]


def _whole_summary(callback: SummaryCallback, trainer: Any, module: Any) -> WholeModelSummary:
    return WholeModelSummary(module, max_depth=callback._max_depth)
