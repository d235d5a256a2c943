"""A model's training step recorded on meta once per batch size, for plan() and the fit searches."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn

from ..capabilities import AttentionCall, fused_attention_on_cpu
from ..errors import ShardkitError
from .activations import InputsFn, record_step
from .models import check_sequence_fits
from .replay import StepRecord, Timeline, UnitSizes
from .result import Plan, UnitRow


class Workload:
    """The step of `model` at a fixed sequence length, its recordings kept for reuse."""

    def __init__(self, model: nn.Module, units: list[nn.Module], seq: int | None,
                 inputs: InputsFn | None, compute_dtype: torch.dtype | None,
                 direct_numel: int | None,
                 fused_attention: Callable[[AttentionCall], bool] = fused_attention_on_cpu) -> None:
        if getattr(model, "config", None) is not None:  # a transformers model: its positions
            check_sequence_fits(model.config, model, seq)
        self.model, self.units, self.seq = model, units, seq
        self.inputs, self.compute_dtype, self.direct_numel = inputs, compute_dtype, direct_numel
        self.fused_attention = fused_attention  # the target backend's kernel choice
        self._records: dict[tuple[bool, int], StepRecord] = {}

    def record(self, batch: int, activation_checkpointing: bool) -> StepRecord:
        """The recorded step at `batch` (simulated on first use)."""
        key = (bool(activation_checkpointing), batch)
        if key not in self._records:
            # checkpoint_layers gets every unit's class below the root, as a user would pass.
            classes = tuple(dict.fromkeys(type(m) for m in self.units[:-1]))
            self._records[key] = record_step(
                self.model, self.units, batch, 1 if self.seq is None else self.seq, self.inputs,
                self.compute_dtype, classes if activation_checkpointing else (), self.direct_numel,
                self.fused_attention)
        return self._records[key]

    def timeline(self, activation_checkpointing: bool, batch: int | None = None) -> Timeline:
        """The step at `batch`, or (None) for every batch: sizes through batches 1 and 2.

        A model that runs other ops at batch 1 (a squeeze, a special case) is extrapolated
        through 2 and 3 instead, and only batch 1 itself is then taken from its own recording."""
        if batch is not None:
            return Timeline.at(self.record(batch, activation_checkpointing))
        try:
            return Timeline.between(self.record(1, activation_checkpointing),
                                    self.record(2, activation_checkpointing))
        except ShardkitError:
            return Timeline.between(self.record(2, activation_checkpointing),
                                    self.record(3, activation_checkpointing))


def unit_sizes(rows: tuple[UnitRow, ...] | list[UnitRow], cpu_offload: bool) -> list[UnitSizes]:
    """What the engine allocates per unit, for the replayed step (rows in the engine's order)."""
    # A shard group of one (NO_SHARD) gathers too: into a buffer of its own, from the shard.
    return [UnitSizes(row.unsharded_bytes, row.reduce_bytes, 0 if cpu_offload else row.grad_shard_bytes,
                      row.reshard_after_forward, root=(i == len(rows) - 1))
            for i, row in enumerate(rows)]


def fixed_bytes(static: Plan) -> int:
    """Device bytes held across steps: persistent shards and state, less the gradients
    (zero_grad(set_to_none=True), torch's default, frees them; the step makes them again)."""
    grads_on_device = 0 if static.cpu_offload else static.persistent["grads"]
    return static.persistent_device - grads_on_device


def with_step(static: Plan, step_bytes: int, batch: int, seq: int | None,
              activation_checkpointing: bool) -> Plan:
    """`static` (a plan without a batch) with the step's bytes at `batch` added to its peak."""
    return dataclasses.replace(static, batch=batch, seq=seq, step_bytes=step_bytes,
                               activation_checkpointing=bool(activation_checkpointing),
                               peak_bytes=fixed_bytes(static) + step_bytes)
