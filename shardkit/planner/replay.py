"""A rehearsed step as a timeline of allocations whose sizes are affine in the batch.

Asking "what fits" needs a configuration's peak at many batch sizes; rehearsing the step
(rehearsal.py) at each would cost seconds apiece for a large model. Every activation is a batch
of samples: two rehearsals at different batch sizes that run the same events give each
allocation's size as an affine function of the batch, so one timeline answers for every batch;
`Timeline.between` refuses when the recordings differ in anything but size (a model that takes
another path at batch 1, say).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ShardkitError

# Event kinds. ("alloc", nbytes) numbers allocations in order; ("free", n) frees the n-th.
ALLOC, FREE = "alloc", "free"


@dataclass(frozen=True)
class StepRecord:
    """One rehearsed step at one batch size: what was live as it began, then its device
    allocations and frees."""

    batch: int
    events: tuple[tuple, ...]
    allowance: int = 0  # bytes that may be live at any moment besides (a lingering collective's)


@dataclass(frozen=True)
class Timeline:
    """A recorded step whose allocation sizes are `base + batch * per_sample`."""

    events: tuple[tuple, ...]  # allocation sizes replaced by their index into base/per_sample
    base: tuple[int, ...]
    per_sample: tuple[int, ...]
    batches: tuple[int, ...]  # the batch sizes it was recorded at (one: valid there only)
    allowance: int = 0  # StepRecord.allowance: added to every moment

    @classmethod
    def at(cls, record: StepRecord) -> Timeline:
        """The timeline of one recording: exact at its own batch size."""
        events, sizes = _numbered(record.events)
        return cls(events, tuple(sizes), (0,) * len(sizes), (record.batch,), record.allowance)

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
        # What lingers is a gradient: the same at every batch.
        return cls(events, tuple(base), tuple(per_sample), (small.batch, large.batch),
                   max(small.allowance, large.allowance))

    def valid_at(self, batch: int) -> bool:
        """Whether this timeline gives exact sizes at `batch` (from its first batch on, or there)."""
        return batch >= self.batches[0] if len(self.batches) == 2 else batch in self.batches

    def high_points(self) -> list[tuple[int, int]]:
        """Every allocation's moment as (bytes live, bytes per sample live)."""
        fixed = scaled = 0
        points = []
        for kind, index in self.events:
            sign = 1 if kind == ALLOC else -1
            fixed += sign * self.base[index]
            scaled += sign * self.per_sample[index]
            if kind == ALLOC:
                points.append((fixed + self.allowance, scaled))
        return points or [(self.allowance, 0)]

    def peak(self, batch: int) -> int:
        """The step's high-water mark at `batch`."""
        if not self.valid_at(batch):
            raise ShardkitError(f"this timeline holds for batch {self.batches[0]}"
                                f"{' and up' if len(self.batches) == 2 else ' only'}, not {batch}")
        return peak_at(self.high_points(), batch)


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
