"""A recorded step replayed against the engine's buffers of one configuration.

Simulating a step on the meta device costs seconds for a 7B model; asking "what fits" needs its
peak for many batch sizes, strategies and world sizes. The ops a step runs do not depend on the
strategy, the world size or the offload (the engine's hooks only add its own buffers between
them), so the step is recorded once as a sequence of events: each storage an op allocates or
frees, and the moments the engine gathers, reshards, releases, reduces and keeps. `Timeline`
replays them with any configuration's buffer sizes (`UnitSizes`) in microseconds. And every
activation is a batch of samples: two recordings at different batch sizes that run the same
events give each allocation's size as an affine function of the batch, so one timeline answers
for every batch; `Timeline.between` refuses when the recordings differ in anything but size.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ShardkitError

# Event kinds. ("alloc", nbytes) numbers allocations in order; ("free", n) frees the n-th.
ALLOC, FREE = "alloc", "free"
GATHER, AFTER_FORWARD, RELEASE, REDUCE, KEEP = "gather", "after_forward", "release", "reduce", "keep"


@dataclass(frozen=True)
class UnitSizes:
    """The engine's buffers for one unit under one configuration, in bytes."""

    gathered_bytes: int  # the unit's parameters gathered, in the compute dtype
    reduce_bytes: int  # the flat reduce-scatter input of its trainable gradients
    grad_shard_bytes: int  # the reduced gradient shard it keeps (0 when offloaded to the host)
    reshard_after_forward: bool | int
    root: bool = False


@dataclass(frozen=True)
class StepRecord:
    """One simulated step at one batch size: op allocations, frees and the engine's moments."""

    batch: int
    events: tuple[tuple, ...]


@dataclass(frozen=True)
class Timeline:
    """A recorded step whose allocation sizes are `base + batch * per_sample`."""

    events: tuple[tuple, ...]  # allocation sizes replaced by their index into base/per_sample
    base: tuple[int, ...]
    per_sample: tuple[int, ...]
    batches: tuple[int, ...]  # the batch sizes it was recorded at (one: valid there only)

    @classmethod
    def at(cls, record: StepRecord) -> Timeline:
        """The timeline of one recording: exact at its own batch size."""
        events, sizes = _numbered(record.events)
        return cls(events, tuple(sizes), (0,) * len(sizes), (record.batch,))

    @classmethod
    def between(cls, small: StepRecord, large: StepRecord) -> Timeline:
        """The timeline through two recordings at different batch sizes (sizes affine in batch)."""
        events, first = _numbered(small.events)
        other_events, second = _numbered(large.events)
        span = large.batch - small.batch
        if events != other_events or span <= 0:
            raise ShardkitError("the step runs different ops at batch sizes "
                                f"{small.batch} and {large.batch}; it cannot be extrapolated")
        per_sample = []
        for a, b in zip(first, second):
            if (b - a) % span:
                raise ShardkitError(f"an allocation grows by {b - a} bytes from batch {small.batch} "
                                    f"to {large.batch}: not proportional to the batch")
            per_sample.append((b - a) // span)
        base = [a - small.batch * s for a, s in zip(first, per_sample)]
        return cls(events, tuple(base), tuple(per_sample), (small.batch, large.batch))

    def valid_at(self, batch: int) -> bool:
        """Whether this timeline gives exact sizes at `batch` (from its first batch on, or there)."""
        return batch >= self.batches[0] if len(self.batches) == 2 else batch in self.batches

    def high_points(self, units: list[UnitSizes], prefetch: int) -> list[tuple[int, int]]:
        """Every allocation's moment as (bytes live, bytes per sample live) under `units`."""
        return _Replay(self, units, prefetch).run()

    def peak(self, units: list[UnitSizes], prefetch: int, batch: int) -> int:
        """The step's high-water mark at `batch` under `units`."""
        if not self.valid_at(batch):
            raise ShardkitError(f"this timeline holds for batch {self.batches[0]}"
                                f"{' and up' if len(self.batches) == 2 else ' only'}, not {batch}")
        return peak_at(self.high_points(units, prefetch), batch)


def peak_at(points: list[tuple[int, int]], batch: int) -> int:
    """The largest of `fixed + batch * per_sample` over the points."""
    return max(fixed + batch * per_sample for fixed, per_sample in points)


def _numbered(events: tuple[tuple, ...]) -> tuple[tuple[tuple, ...], list[int]]:
    """Events with each allocation's size swapped for its number, and the sizes apart."""
    out: list[tuple] = []
    sizes: list[int] = []
    for event in events:
        if event[0] == ALLOC:
            out.append((ALLOC, len(sizes)))
            sizes.append(event[1])
        else:
            out.append(event)
    return tuple(out), sizes


class _Replay:
    """The engine's buffer bookkeeping (as shardkit/sharding does it) over a recorded step."""

    def __init__(self, timeline: Timeline, units: list[UnitSizes], prefetch: int) -> None:
        self.timeline, self.units, self.prefetch = timeline, units, prefetch
        self.fixed = 0  # bytes live that do not scale with the batch (incl. the engine's)
        self.scaled = 0  # bytes per sample live
        self.gathered: dict[int, int | None] = {}
        self.in_flight = 0
        self.points: list[tuple[int, int]] = []

    def _grow(self, fixed: int, scaled: int = 0) -> None:
        self.fixed += fixed
        self.scaled += scaled
        self.points.append((self.fixed, self.scaled))

    def run(self) -> list[tuple[int, int]]:
        base, per_sample = self.timeline.base, self.timeline.per_sample
        for event in self.timeline.events:
            kind = event[0]
            if kind == ALLOC:
                self._grow(base[event[1]], per_sample[event[1]])
            elif kind == FREE:
                self.fixed -= base[event[1]]
                self.scaled -= per_sample[event[1]]
            elif kind == GATHER:
                self._gather(event[1])
            elif kind == AFTER_FORWARD:
                self._after_forward(event[1])
            elif kind == RELEASE:
                self.fixed -= (self.gathered.pop(event[1], None) or 0) + self.in_flight
                self.in_flight = 0
            elif kind == REDUCE:
                self.in_flight = self.units[event[1]].reduce_bytes
                self._grow(self.in_flight)
            elif kind == KEEP:
                self._grow(self.units[event[1]].grad_shard_bytes)
        return self.points or [(0, 0)]

    def _gather(self, order: tuple[int, ...]) -> None:
        # A new buffer exists before the slice it replaces is dropped.
        for i in order[:1 + self.prefetch]:
            held, full = self.gathered.get(i), self.units[i].gathered_bytes
            if held is None or held < full:
                self._grow(full)
                self.fixed -= held or 0
                self.gathered[i] = full

    def _after_forward(self, i: int) -> None:
        unit = self.units[i]
        if unit.root or unit.reshard_after_forward is False:
            return
        kept = 0 if unit.reshard_after_forward is True else unit.gathered_bytes // unit.reshard_after_forward
        if kept:
            self._grow(kept)
        self.fixed -= self.gathered.get(i) or 0
        self.gathered[i] = kept or None
