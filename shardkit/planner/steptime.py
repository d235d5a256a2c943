"""Step time at scale, on paper: the plan's collectives over an alpha-beta link, with compute.

Each collective is a ring, as GPU collective libraries and gloo run them for large messages: an all-gather or a
reduce-scatter over p ranks takes p - 1 steps that each move one rank's chunk (alpha + chunk /
beta), an all-reduce twice that with chunks of n / p. Alpha (latency per step) and beta (bytes a
rank sends per second) are the link's: a group inside one node uses the intra-node link, a group
that spans nodes the inter-node one (the ring crosses it on every step).

The step is then scheduled unit by unit, in the engine's order, on two resources that each do
one thing at a time: compute, and the link (collectives queue in the order the engine issues
them). Without overlap the step is the sum of both. With overlap a unit's compute waits only
for its own gather: the next `prefetch` units' gathers and the previous unit's reduction run
meanwhile. Where compute and collectives share the host's cores (gloo on CPU), the host reaches
a unit's hooks only when the previous unit's compute is done (`host_bound`), which delays the
gathers the engine issues there.

What it cannot predict: contention between compute and communication for memory bandwidth or
cores, kernel launch and Python overhead beyond what the measured compute contains, the tree
and small-message protocols collective libraries pick, stragglers, and other jobs' traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ShardkitError
from .result import Plan
from .nodes import QUANTIZED_KINDS


@dataclass(frozen=True)
class Link:
    """An interconnect as the alpha-beta model sees it."""

    name: str
    latency_s: float  # alpha: per ring step
    bandwidth: float  # beta: bytes per second one rank sends
    # A reduce-scatter's time over the ring formula's: 1 where it is a ring of its own (GPUs),
    # about 2 where a backend runs it as an all-reduce (gloo through shardkit's cpu backend).
    reduce_scatter_factor: float = 1.0


# Nominal figures (line rate x ~0.9, typical per-step latency): replace them with what your
# vendor's collective benchmarks (or benchmarks/bench_step_model.py on CPU) measure.
LINKS = {
    "nvlink": Link("nvlink", 5e-6, 360e9),  # NVLink 4 (H100 SXM), 450 GB/s per direction
    "ib": Link("ib", 10e-6, 45e9),  # InfiniBand NDR, 400 Gb/s per GPU
    "ethernet": Link("ethernet", 30e-6, 11e9),  # 100 GbE per node
}


@dataclass(frozen=True)
class Topology:
    """Ranks per node and the links inside and between nodes."""

    intra: Link
    inter: Link
    ranks_per_node: int

    def link(self, group_size: int) -> Link:
        """The link a ring over `group_size` consecutive ranks is limited by."""
        return self.intra if group_size <= self.ranks_per_node else self.inter


@dataclass(frozen=True)
class UnitTimes:
    """Compute seconds per unit (the plan's unit order, root last: its own ops only)."""

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    optimizer_s: float = 0.0  # the optimizer step over the whole model at one rank

    @classmethod
    def split(cls, plan: Plan, forward_s: float, backward_s: float,
              optimizer_s: float = 0.0) -> UnitTimes:
        """Whole-model compute shared among the units by parameter count (a matmul's work is
        proportional to its weights; attention's score math and embedding lookups are not)."""
        total = sum(u.params for u in plan.units) or 1
        shares = [u.params / total for u in plan.units]
        return cls(tuple(forward_s * s for s in shares), tuple(backward_s * s for s in shares),
                   optimizer_s)


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds per training step on one configuration."""

    world_size: int
    compute_s: float  # forward + backward + optimizer (on this rank's shards)
    communication_s: float  # every collective back to back
    serial_s: float  # no overlap: compute + communication
    overlapped_s: float  # gathers and reductions overlapping compute, as scheduled

    @property
    def exposed_communication_s(self) -> float:
        """Communication the overlap does not hide."""
        return self.overlapped_s - self.compute_s


# The gradient reductions' call kinds, exact and quantized (planner/nodes.py).
REDUCTIONS = ("reduce_scatter", "all_reduce", *QUANTIZED_KINDS)


def collective_seconds(kind: str, nbytes: int, group: int, link: Link) -> float:
    """Ring time of one collective; nbytes as comm_stats counts it (see UnitRow.collectives)."""
    if group <= 1:
        return 0.0
    steps = group - 1
    if kind == "all_reduce":  # a reduce-scatter then an all-gather of n / p chunks
        return 2 * steps * (link.latency_s + nbytes / group / link.bandwidth)
    if kind in ("forward_gather", "backward_gather") or kind in QUANTIZED_KINDS:
        # A ring all-gather, or a quantized reduction's all-to-all or all-gather: (N-1) chunks.
        return steps * (link.latency_s + nbytes / link.bandwidth)
    if kind == "reduce_scatter":
        return link.reduce_scatter_factor * steps * (link.latency_s + nbytes / link.bandwidth)
    raise ShardkitError(f"unknown collective {kind!r}")


def step_time(plan: Plan, times: UnitTimes, topology: Topology, host_bound: bool = False) -> StepTime:
    """Schedule one step of `plan` with per-unit compute `times` over `topology`."""
    units = plan.units
    if len(times.forward_s) != len(units) or len(times.backward_s) != len(units):
        raise ShardkitError(f"compute times for {len(times.forward_s)} units, the plan has {len(units)}")
    optimizer = times.optimizer_s / plan.shard_group_size  # each rank steps its shards only

    def seconds(unit: int, kinds: tuple[str, ...]) -> list[float]:
        return [collective_seconds(kind, nbytes, group, topology.link(group))
                for kind, nbytes, group in units[unit].collectives if kind in kinds]

    compute = sum(times.forward_s) + sum(times.backward_s) + optimizer
    communication = sum(sum(seconds(i, ("forward_gather", "backward_gather", *REDUCTIONS)))
                        for i in range(len(units)))
    overlapped = _Schedule(plan, times, seconds, host_bound).run() + optimizer
    return StepTime(plan.world_size, compute, communication, compute + communication, overlapped)


class _Schedule:
    """Compute and the link as two queues, filled in the order the engine issues work."""

    def __init__(self, plan: Plan, times: UnitTimes, seconds, host_bound: bool) -> None:
        self.plan, self.times, self.seconds, self.host_bound = plan, times, seconds, host_bound
        self.compute_free = 0.0
        self.link_free = 0.0
        self.host = 0.0  # when the host reaches the next hook
        self.gathered: dict[int, float] = {}  # unit -> when its gather completes

    def _collectives(self, durations: list[float], ready: float) -> float:
        end = ready
        for duration in durations:
            start = max(self.link_free, ready, self.host if self.host_bound else 0.0)
            end = self.link_free = start + duration
        return end

    def _compute(self, duration: float, ready: float) -> float:
        start = max(self.compute_free, ready)
        self.compute_free = start + duration
        if self.host_bound:
            self.host = self.compute_free
        return self.compute_free

    def _gather(self, order: list[int], kind: str) -> None:
        for unit in order[:1 + self.plan.prefetch]:
            if unit not in self.gathered:
                self.gathered[unit] = self._collectives(self.seconds(unit, (kind,)), 0.0)

    def run(self) -> float:
        units = len(self.plan.units)
        root, layers = units - 1, list(range(units - 1))
        self._gather([root], "forward_gather")
        for i in layers:  # forward: the root's own ops (head, loss) after the layers
            self._gather(layers[i:], "forward_gather")
            self._compute(self.times.forward_s[i], self.gathered[i])
        self._compute(self.times.forward_s[root], self.gathered[root])
        self.gathered = {}  # backward: units gathered again where resharded
        self._gather([root], "backward_gather")
        end = self._compute(self.times.backward_s[root], self.gathered[root])
        reduced = 0.0
        for i in reversed(layers):
            self._gather(layers[i::-1], "backward_gather")
            end = self._compute(self.times.backward_s[i], self.gathered[i])
            reduced = self._collectives(self.seconds(i, REDUCTIONS), end)
        # The root's gradients (embedding) are complete last.
        reduced = self._collectives(self.seconds(root, REDUCTIONS), end)
        return max(end, reduced)
