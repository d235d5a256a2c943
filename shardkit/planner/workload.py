"""A model's training step, rehearsed per configuration and batch size, kept for reuse.

plan() asks for one configuration at one batch; the fit searches ask for many batches of a few
configurations, so each configuration is rehearsed at two batch sizes and its timeline
(replay.py) answers for the rest.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from torch import nn

from ..capabilities import Capabilities
from ..sharding.setup.plan import plan_units
from ..sharding.wrap_policies import as_policy
from ..errors import ShardkitError
from .activations import InputsFn
from .models import check_sequence_fits
from .rehearsal import Rehearsal, StepSetup, rehearse
from .replay import Timeline
from .result import Plan
from .tensor_parallel import TensorParallel

# shard()'s options a plan passes through unchanged to the rehearsal.
SHARD_OPTIONS = ("auto_wrap_policy", "mixed_precision", "prefetch", "hybrid_group_size",
                 "reshard_after_forward", "quantize")


@dataclasses.dataclass(frozen=True)
class Target:
    """The backend a plan is for: its declared capabilities and device type (never started)."""

    capabilities: Capabilities
    device_type: str


class Workload:
    """The step of `model` at a fixed sequence length, its rehearsals kept for reuse."""

    def __init__(self, model: nn.Module, seq: int | None, inputs: InputsFn | None,
                 options: dict[str, Any], optimizer: str, target: Target,
                 threads_per_rank: int = 1, tensor_parallel: TensorParallel | None = None) -> None:
        if getattr(model, "config", None) is not None:  # a transformers model: its positions
            check_sequence_fits(model.config, model, seq)
        self.model, self.seq, self.inputs = model, seq, inputs
        self.options = {k: options[k] for k in SHARD_OPTIONS if options.get(k) is not None}
        self.optimizer, self.target, self.threads = optimizer, target, threads_per_rank
        self.tensor_parallel = tensor_parallel
        units = plan_units(model, as_policy(self.options.get("auto_wrap_policy")))
        # checkpoint_layers gets every unit's class below the root, as a user would pass.
        self.layer_classes = tuple(dict.fromkeys(type(u.module) for u in units[:-1]))
        self._rehearsals: dict[tuple, Rehearsal] = {}

    def rehearsal(self, world_size: int, strategy: str, cpu_offload: bool,
                  activation_checkpointing: bool, batch: int) -> Rehearsal:
        """The configuration's step rehearsed at `batch` (on first use)."""
        key = (world_size, strategy, bool(cpu_offload), bool(activation_checkpointing), batch)
        if key not in self._rehearsals:
            setup = StepSetup(
                world_size, {**self.options, "strategy": strategy, "cpu_offload": cpu_offload},
                self.optimizer, self.target.capabilities, self.target.device_type,
                self.layer_classes if activation_checkpointing else (), self.threads,
                self.tensor_parallel)
            self._rehearsals[key] = rehearse(self.model, setup, batch,
                                             1 if self.seq is None else self.seq, self.inputs)
        return self._rehearsals[key]

    def timeline(self, world_size: int, strategy: str, cpu_offload: bool,
                 activation_checkpointing: bool, batch: int | None = None) -> Timeline:
        """The configuration's step at `batch`, or (None) for every batch: sizes through
        batches 1 and 2.

        A model that runs other ops at batch 1 (a squeeze, a special case) is extrapolated
        through 2 and 3 instead, and only batch 1 itself is then taken from its own rehearsal."""
        def record(b: int):
            return self.rehearsal(world_size, strategy, cpu_offload, activation_checkpointing,
                                  b).record

        if batch is not None:
            return Timeline.at(record(batch))
        try:
            return Timeline.between(record(1), record(2))
        except ShardkitError:
            return Timeline.between(record(2), record(3))


def fixed_bytes(static: Plan) -> int:
    """Device bytes held across steps: persistent shards and state, less the gradients
    (zero_grad(set_to_none=True), torch's default, frees them; the step makes them again)."""
    grads_on_device = 0 if static.cpu_offload else static.persistent["grads"]
    return static.persistent_device - grads_on_device


def planned_peak(rehearsed_peak: int, target: Capabilities) -> int:
    """The rehearsed peak with the target's margin for what no tensor shows."""
    return (rehearsed_peak + target.library_workspace_bytes
            + math.ceil(target.peak_margin * rehearsed_peak))


def with_step(static: Plan, timeline: Timeline, target: Capabilities, batch: int,
              seq: int | None, activation_checkpointing: bool) -> Plan:
    """`static` (a plan without a batch) with the rehearsed step's peak at `batch`, and the
    target's margin for what the rehearsal cannot see (a lingering collective's tensor, the
    libraries' workspaces, the declared share)."""
    rehearsed = timeline.peak(batch)
    peak = planned_peak(rehearsed, target)
    margin = peak - rehearsed + timeline.allowance
    return dataclasses.replace(static, batch=batch, seq=seq,
                               step_bytes=max(peak - fixed_bytes(static), 0),
                               activation_checkpointing=bool(activation_checkpointing),
                               peak_bytes=peak, margin_bytes=margin)
