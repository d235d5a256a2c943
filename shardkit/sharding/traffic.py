"""Per-rank counters of the bytes the engine sends through the backend (ring-algorithm model)."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from ..logs import logger


class CommStats:
    """Bytes each rank sends per collective kind, using bandwidth-optimal ring costs."""

    def __init__(self) -> None:
        self.bytes: defaultdict[str, float] = defaultdict(float)  # all-reduce costs a fraction
        self.calls: Counter[str] = Counter()
        self.peak_prefetch_in_flight = 0  # most all-gathers issued ahead of use at one time

    def all_gather(self, shard_bytes: int, group_size: int) -> None:
        """Record an all-gather: a ring sends (N-1) shards per rank."""
        self._add("all_gather", (group_size - 1) * shard_bytes, group_size, shard_bytes)

    def reduce_scatter(self, shard_bytes: int, group_size: int) -> None:
        """Record a reduce-scatter: a ring sends (N-1) output-sized chunks per rank."""
        self._add("reduce_scatter", (group_size - 1) * shard_bytes, group_size, shard_bytes)

    def all_reduce(self, nbytes: int, group_size: int) -> None:
        """Record an all-reduce: reduce-scatter + all-gather, 2(N-1)/N of the tensor per rank."""
        self._add("all_reduce", 2 * (group_size - 1) * nbytes / group_size, group_size, nbytes)

    def note_in_flight(self, count: int) -> None:
        """Remember the largest number of prefetched all-gathers in flight together."""
        self.peak_prefetch_in_flight = max(self.peak_prefetch_in_flight, count)

    def _add(self, kind: str, nbytes: float, group_size: int, payload: int) -> None:
        logger.debug("%s of %d bytes per rank over %d rank(s)", kind, payload, group_size)
        if group_size > 1:
            self.bytes[kind] += nbytes
            self.calls[kind] += 1

    def snapshot(self) -> dict:
        """Return {"all_gather": bytes, ..., "total": bytes, "calls": {kind: count}}."""
        out: dict[str, Any] = {kind: int(round(self.bytes.get(kind, 0)))
               for kind in ("all_gather", "reduce_scatter", "all_reduce")}
        out["total"] = sum(out.values())
        out["calls"] = dict(self.calls)
        out["peak_prefetch_in_flight"] = self.peak_prefetch_in_flight
        return out

    def reset(self) -> None:
        """Zero every counter."""
        self.bytes.clear()
        self.calls.clear()
        self.peak_prefetch_in_flight = 0
