"""Per-rank counters of the bytes the engine sends through the backend (ring-algorithm model;
the all-to-alls of quantized reductions exactly: a chunk to each peer).

In a ring each rank sends to the next rank of its group, so whether its bytes cross a node
boundary depends only on where that successor lives. Ranks are numbered node by node, as torchrun
and SLURM number them (``ranks_per_node`` consecutive ranks per node): the bytes a rank sends in
a collective whose ring successor is on another node are counted as inter-node, the rest as
intra-node. An all-to-all sends one chunk to every peer, so its inter-node bytes are the chunks
for peers on other nodes. The planner applies the same rules to every rank to predict both
before a launch.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any, Sequence

from ...logs import logger

KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def bytes_sent(kind: str, payload: float, group_size: int) -> float:
    """Bytes one rank sends in a ring `kind` of `payload` bytes (the shard, or the all-reduced tensor)."""
    if kind == "all_reduce":
        return 2 * (group_size - 1) * payload / group_size
    return (group_size - 1) * payload


def peers_off_node(ranks: Sequence[int], index: int, ranks_per_node: int | None) -> int:
    """How many members of a group over `ranks` live on another node than the one at `index`."""
    if not ranks_per_node:
        return 0
    node = ranks[index] // ranks_per_node
    return sum(1 for r in ranks if r // ranks_per_node != node)


def successor_off_node(ranks: Sequence[int], index: int, ranks_per_node: int | None) -> bool:
    """True when the rank at `index` of a ring over `ranks` (global ranks) sends to another node."""
    if not ranks_per_node or len(ranks) < 2:
        return False
    return ranks[(index + 1) % len(ranks)] // ranks_per_node != ranks[index] // ranks_per_node


class CommStats:
    """Bytes each rank sends per collective kind, using bandwidth-optimal ring costs."""

    def __init__(self, ranks_per_node: int | None = None) -> None:
        self.ranks_per_node = ranks_per_node  # None: one node, nothing crosses
        self.bytes: defaultdict[str, float] = defaultdict(float)  # all-reduce costs a fraction
        self.inter_node: defaultdict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self.peak_prefetch_in_flight = 0  # most all-gathers issued ahead of use at one time

    def crosses_node(self, group: Any) -> bool:
        """Whether this rank's ring successor in `group` (a Group) is on another node."""
        return group.size > 1 and successor_off_node(group.ranks, group.rank, self.ranks_per_node)

    def all_gather(self, shard_bytes: int, group_size: int, crosses_node: bool = False,
                   kind: str = "all_gather") -> None:
        """Record an all-gather: a ring sends (N-1) shards per rank (counted under `kind`)."""
        self._add(kind, group_size, shard_bytes, crosses_node, formula="all_gather")

    def reduce_scatter(self, shard_bytes: int, group_size: int, crosses_node: bool = False) -> None:
        """Record a reduce-scatter: a ring sends (N-1) output-sized chunks per rank."""
        self._add("reduce_scatter", group_size, shard_bytes, crosses_node)

    def all_reduce(self, nbytes: int, group_size: int, crosses_node: bool = False) -> None:
        """Record an all-reduce: reduce-scatter + all-gather, 2(N-1)/N of the tensor per rank."""
        self._add("all_reduce", group_size, nbytes, crosses_node)

    def peers_elsewhere(self, group: Any) -> int:
        """How many members of `group` (a Group) live on another node than this rank."""
        return peers_off_node(group.ranks, group.rank, self.ranks_per_node)

    def all_to_all(self, kind: str, chunk_bytes: int, group_size: int,
                   peers_elsewhere: int = 0) -> None:
        """Record an all-to-all sending one `chunk_bytes` chunk to each peer, counted under `kind`
        (the reduction it serves): its inter-node bytes are exact, a chunk per peer elsewhere."""
        logger.debug("all-to-all (%s) of %d-byte chunks over %d rank(s)", kind, chunk_bytes,
                     group_size)
        if group_size > 1:
            self.bytes[kind] += (group_size - 1) * chunk_bytes
            self.inter_node[kind] += chunk_bytes * peers_elsewhere
            self.calls[kind] += 1

    def note_in_flight(self, count: int) -> None:
        """Remember the largest number of prefetched all-gathers in flight together."""
        self.peak_prefetch_in_flight = max(self.peak_prefetch_in_flight, count)

    def _add(self, kind: str, group_size: int, payload: int, crosses_node: bool,
             formula: str | None = None) -> None:
        logger.debug("%s of %d bytes per rank over %d rank(s)", kind, payload, group_size)
        if group_size > 1:
            sent = bytes_sent(formula or kind, payload, group_size)
            self.bytes[kind] += sent
            if crosses_node:
                self.inter_node[kind] += sent
            self.calls[kind] += 1

    def snapshot(self) -> dict:
        """Return {"all_gather": bytes, ..., "total": bytes, "calls": {kind: count},
        "inter_node": {kind: bytes, "total": bytes}, "intra_node": bytes}."""
        out: dict[str, Any] = {kind: int(round(self.bytes.get(kind, 0))) for kind in KINDS}
        out["total"] = sum(out.values())
        inter = {kind: int(round(self.inter_node.get(kind, 0))) for kind in KINDS}
        inter["total"] = sum(inter.values())
        out["inter_node"] = inter
        out["intra_node"] = out["total"] - inter["total"]
        out["calls"] = dict(self.calls)
        out["peak_prefetch_in_flight"] = self.peak_prefetch_in_flight
        return out

    def reset(self) -> None:
        """Zero every counter."""
        self.bytes.clear()
        self.inter_node.clear()
        self.calls.clear()
        self.peak_prefetch_in_flight = 0
