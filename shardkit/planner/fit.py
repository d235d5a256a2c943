"""What fits before launch: the largest batch per rank, or the fewest ranks, in a memory budget.

Every answer is a plan (shardkit.plan with batch=) at the edge: the batch (or world size) it
returns fits in `device_memory` per rank and one more sample (or the next smaller world size
tried) does not. Each configuration's step is rehearsed on the meta device at batches 1 and 2
(rehearsal.py) and its timeline answers for every batch (replay.py): a table of twelve
configurations costs twenty-four rehearsals, each about as long as a step on meta.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from ..errors import ShardkitError
from .activations import InputsFn
from .build import plan, plan_target, step_plan, target_capabilities, threads
from .replay import Timeline, peak_at
from .result import Plan, _size
from .workload import Workload, planned_peak

TABLE_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")


@dataclass(frozen=True)
class Fit:
    """What fits one configuration in `device_memory` bytes per rank, and the plan at that edge."""

    device_memory: int
    strategy: str
    activation_checkpointing: bool
    cpu_offload: bool
    world_size: int | None  # None: no world size up to the search's limit fits
    batch: int | None  # per rank; 0: not even one sample fits; None: no step simulated
    plan: Plan  # at the answer; where nothing fits, at the smallest case tried (what is over)
    headroom: float = 0.0  # the allocator's share kept free: planned peaks fit device_memory / (1 + it)

    @property
    def usable_memory(self) -> int:
        """The bytes the planned peak may reach: device_memory less the allocator's headroom."""
        return usable(self.device_memory, self.headroom)

    @property
    def fits(self) -> bool:
        """Whether anything fits."""
        return self.batch != 0 and self.world_size is not None

    def summary(self) -> str:
        """One line: the answer and the peak it reaches against the budget."""
        how = (f"{self.strategy}{', activation checkpointing' if self.activation_checkpointing else ''}"
               f"{', cpu_offload' if self.cpu_offload else ''}")
        peak, budget = _size(self.plan.peak_bytes), _size(self.device_memory)
        if self.headroom:
            budget += f" ({_size(self.usable_memory)} planned, {self.headroom:.0%} allocator headroom)"
        at = "" if self.plan.batch is None else f"batch {self.plan.batch} per rank "
        scope = " (activations not included)" if self.plan.batch is None else ""
        if not self.fits:
            return (f"{how}: does not fit in {budget} per rank: needs {peak} at {at}on "
                    f"{self.plan.world_size} rank(s){scope}")
        return f"{how}: {at}on {self.world_size} rank(s), peak {peak} of {budget}{scope}"

    def to_dict(self) -> dict[str, Any]:
        """The answer as JSON-friendly builtins (the plan as Plan.to_dict)."""
        return {"device_memory": self.device_memory, "strategy": self.strategy,
                "activation_checkpointing": self.activation_checkpointing,
                "cpu_offload": self.cpu_offload, "world_size": self.world_size, "batch": self.batch,
                "fits": self.fits, "headroom": self.headroom, "usable_memory": self.usable_memory,
                "plan": self.plan.to_dict()}


class _Fitter:
    """One model and its recorded steps, asked about many configurations."""

    def __init__(self, model: nn.Module, seq: int | None, example_inputs: InputsFn | None,
                 options: dict[str, Any]) -> None:
        for key in ("batch", "activation_checkpointing", "world_size", "strategy", "cpu_offload"):
            if key in options:
                raise ShardkitError(f"{key}= is chosen by the search's own arguments here")
        self.model, self.seq, self.options = model, seq, options
        self.target = plan_target(options.get("backend"), options.get("shard_alignment"))
        self.workload = Workload(model, seq, example_inputs, options,
                                 options.get("optimizer", "adam"), self.target,
                                 threads(options.get("threads_per_rank")))
        self._every_batch: dict[tuple, Timeline] = {}

    def static(self, world_size: int, strategy: str, cpu_offload: bool) -> Plan:
        """The plan without a step (cheap: shapes only)."""
        return plan(self.model, world_size, strategy=strategy, cpu_offload=cpu_offload,
                    seq=None, **self.options)

    def _timeline(self, static: Plan, ac: bool, batch: int | None = None) -> Timeline:
        """The configuration's timeline for every batch (batch None, or once that is known and
        holds at `batch`), else its own rehearsal at `batch`."""
        key = (static.world_size, static.strategy, static.cpu_offload, ac)
        every = self._every_batch.get(key)
        if batch is None and every is None:
            every = self._every_batch[key] = self.workload.timeline(*key)
        if every is not None and (batch is None or every.valid_at(batch)):
            return every
        return self.workload.timeline(*key, batch)

    def batch_peak(self, static: Plan, ac: bool) -> Callable[[int], int]:
        """Peak per rank as a function of the batch, for one configuration."""
        timeline = self._timeline(static, ac)
        points = timeline.high_points()

        def peak(batch: int) -> int:
            if timeline.valid_at(batch):
                return planned_peak(peak_at(points, batch), self.target.capabilities)
            return self.at(static, ac, batch).peak_bytes
        return peak

    def at(self, static: Plan, ac: bool, batch: int) -> Plan:
        """The plan of `static` with the step at `batch`."""
        return step_plan(static, self._timeline(static, ac, batch), self.target, batch, self.seq,
                         ac)

    def largest_batch(self, world_size: int, strategy: str, ac: bool, cpu_offload: bool,
                      budget: int, max_batch: int, headroom: float) -> Fit:
        static = self.static(world_size, strategy, cpu_offload)
        best = _largest(self.batch_peak(static, ac), usable(budget, headroom), max_batch)
        return Fit(budget, static.strategy, ac, cpu_offload, world_size, best,
                   self.at(static, ac, max(best, 1)), headroom)


def _largest(peak: Callable[[int], int], budget: int, limit: int) -> int:
    """The largest n <= limit with peak(n) <= budget (peak never decreases with n), or 0."""
    if peak(1) > budget:
        return 0
    low, high = 1, 2
    while high <= limit and peak(high) <= budget:
        low, high = high, high * 2
    high = min(high, limit + 1)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if peak(mid) <= budget else (low, mid)
    return low


def _budget(device_memory: int) -> int:
    if isinstance(device_memory, bool) or not isinstance(device_memory, int) or device_memory < 1:
        raise ShardkitError(f"device_memory must be a positive number of bytes, got {device_memory!r}")
    return device_memory


def usable(device_memory: int, headroom: float) -> int:
    """The bytes a planned peak may reach in `device_memory` with `headroom` kept for the allocator."""
    return int(device_memory / (1.0 + headroom))


def resolve_headroom(headroom: float | None, options: dict[str, Any]) -> float:
    """`headroom` as given, else the target backend's declared Capabilities.allocator_headroom
    (0 without a backend: the planner's defaults are the host's)."""
    if headroom is None:
        caps = target_capabilities(options.get("backend"))
        return 0.0 if caps is None else caps.allocator_headroom
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not 0 <= headroom < 10:
        raise ShardkitError(f"headroom is the fraction of the planned peak kept free for the "
                            f"allocator, from 0 to 10, got {headroom!r}")
    return float(headroom)


def largest_batch(model: nn.Module, world_size: int, device_memory: int, seq: int | None = None, *,
                  strategy: str = "FULL_SHARD", activation_checkpointing: bool = False,
                  cpu_offload: bool = False, example_inputs: InputsFn | None = None,
                  max_batch: int = 1 << 20, headroom: float | None = None, **options: Any) -> Fit:
    """The largest per-rank batch whose planned peak fits in `device_memory` bytes per rank.

    headroom: the fraction of the planned peak the device's allocator may hold on top (planned
    peaks must fit device_memory / (1 + headroom)); None takes the backend's declared
    Capabilities.allocator_headroom (0.45 on cuda and xpu, 0 on the host). Other keyword
    arguments are shardkit.plan()'s (auto_wrap_policy, mixed_precision, backend, ...)."""
    fitter = _Fitter(model, seq, example_inputs, options)
    return fitter.largest_batch(world_size, strategy, bool(activation_checkpointing),
                                bool(cpu_offload), _budget(device_memory), max_batch,
                                resolve_headroom(headroom, options))


def fit_table(model: nn.Module, world_size: int, device_memory: int, seq: int | None = None, *,
              strategies: tuple[str, ...] = TABLE_STRATEGIES, example_inputs: InputsFn | None = None,
              max_batch: int = 1 << 20, headroom: float | None = None, **options: Any) -> list[Fit]:
    """largest_batch for each strategy, without and with activation checkpointing and cpu_offload.

    Each strategy runs with its own reshard_after_forward default."""
    if "reshard_after_forward" in options:
        raise ShardkitError("fit_table compares strategies at their own reshard_after_forward "
                            "defaults; use largest_batch for one strategy with another setting")
    fitter, budget = _Fitter(model, seq, example_inputs, options), _budget(device_memory)
    margin = resolve_headroom(headroom, options)
    return [fitter.largest_batch(world_size, strategy, ac, offload, budget, max_batch, margin)
            for strategy in strategies for ac in (False, True) for offload in (False, True)]


def smallest_world_size(model: nn.Module, device_memory: int, batch: int | None = None,
                        seq: int | None = None, *, strategy: str = "FULL_SHARD",
                        activation_checkpointing: bool = False, cpu_offload: bool = False,
                        example_inputs: InputsFn | None = None, max_world_size: int = 1 << 16,
                        headroom: float | None = None, **options: Any) -> Fit:
    """The fewest ranks whose planned peak per rank, at `batch` per rank, fits in `device_memory`.

    Without a batch the peak leaves activations out (as plan() does). World sizes tried are
    multiples of hybrid_group_size and of an int reshard_after_forward where given. Memory per
    rank is taken to shrink as ranks are added (padding aside, sharding only divides it)."""
    budget, ac = _budget(device_memory), bool(activation_checkpointing)
    margin = resolve_headroom(headroom, options)
    planned = usable(budget, margin)
    fitter = _Fitter(model, seq, example_inputs, options)
    stride = math.lcm(*(v for v in (options.get("hybrid_group_size"),
                                    options.get("reshard_after_forward"))
                        if isinstance(v, int) and not isinstance(v, bool)), 1)
    plans: dict[int, Plan] = {}

    def plan_at(multiple: int) -> Plan:
        if multiple not in plans:
            static = fitter.static(multiple * stride, strategy, bool(cpu_offload))
            plans[multiple] = static if batch is None else fitter.at(static, ac, batch)
        return plans[multiple]

    def over(multiple: int) -> int:  # 0 when it fits; never increases with more ranks
        return max(plan_at(multiple).peak_bytes - planned, 0)

    limit = max_world_size // stride
    fits_at = _smallest_fitting(over, limit)
    chosen = plan_at(fits_at if fits_at else max(plans))
    return Fit(budget, chosen.strategy, ac, bool(cpu_offload),
               fits_at * stride if fits_at else None, batch, chosen, margin)


def _smallest_fitting(over: Callable[[int], int], limit: int) -> int:
    """The smallest m <= limit with over(m) == 0 (over never increases with m), or 0."""
    low, high = 0, 1  # over(low) > 0 is known (low == 0 stands for "none tried")
    while over(high) > 0:
        if high >= limit:
            return 0
        low, high = high, min(high * 2, limit)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if over(mid) == 0 else (mid, high)
    return high
