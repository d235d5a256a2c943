"""Which of each rank's bytes cross a node boundary: the engine's ring rule applied to every rank.

A rank's ring sends go to the next rank of the group it collects in; ranks are numbered node by
node. Shard groups (and reshard_after_forward=k groups) are runs of consecutive ranks, replica
groups take every shard-group-size-th rank, exactly as sharding/setup/groups.py builds them, so the
prediction equals what comm_stats(model)["inter_node"] counts on each rank.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

from ..sharding.step.traffic import KINDS, bytes_sent, peers_off_node, successor_off_node


# Call kinds of the quantized collectives (Quantization): the CommStats kind each counts under.
QUANTIZED_KINDS = {"a2a_reduce_scatter": "reduce_scatter", "a2a_node": "reduce_scatter",
                   "a2a_across": "reduce_scatter", "a2a_all_reduce": "all_reduce",
                   "all_reduce_gather": "all_reduce"}
_ACROSS_REPLICAS = ("all_reduce", "a2a_all_reduce", "all_reduce_gather")


def stat_kind(kind: str) -> str:
    """The CommStats kind a planned call (kind as build.py issues it) is counted under."""
    if kind in QUANTIZED_KINDS:
        return QUANTIZED_KINDS[kind]
    return "all_gather" if kind.endswith("gather") else kind


def ring_of(kind: str, size: int, rank: int, world: int, shard_group: int,
            ranks_per_node: int = 1) -> list[int]:
    """The global ranks of the group `rank` runs a `kind` collective of `size` ranks in."""
    if kind in _ACROSS_REPLICAS:  # across replicas: the same position in every shard group
        return list(range(rank % shard_group, world, shard_group))
    if kind == "a2a_across":  # the same position in every node of the shard group
        start = rank - rank % shard_group
        return list(range(start + rank % ranks_per_node, start + shard_group, ranks_per_node))
    start = rank - rank % size
    return list(range(start, start + size))


def inter_node_by_rank(collectives: Iterable[tuple[str, int, int]], world: int, shard_group: int,
                       ranks_per_node: int) -> list[dict[str, int]]:
    """Per rank: {kind: bytes sent to another node, ..., "total"} for one step's collectives."""
    sums: list[defaultdict[str, float]] = [defaultdict(float) for _ in range(world)]
    for kind, payload, size in collectives:
        if size < 2:
            continue
        counted = stat_kind(kind)
        for rank in range(world):
            ring = ring_of(kind, size, rank, world, shard_group, ranks_per_node)
            if kind.startswith("a2a_"):  # a chunk to every peer on another node
                sums[rank][counted] += payload * peers_off_node(ring, ring.index(rank),
                                                                 ranks_per_node)
            elif successor_off_node(ring, ring.index(rank), ranks_per_node):
                formula = "all_gather" if kind.endswith("gather") else counted
                sums[rank][counted] += bytes_sent(formula, payload, size)
    out = []
    for per_kind in sums:
        # Rounded per kind, then totalled, as CommStats.snapshot does.
        row = {kind: int(round(per_kind.get(kind, 0))) for kind in KINDS}
        row["total"] = sum(row.values())
        out.append(row)
    return out
