"""Build each strategy's shard group and replicate group from the world group.

The subgroups one shard() creates belong to that model: a GroupMaker remembers them and
`release_with` destroys them when the model's engine state dies (process groups hold sockets,
threads and, on accelerators, communicators: a notebook that shards model after model would
otherwise keep every one of them). The world group belongs to init() and is never released here.
"""

from __future__ import annotations

import weakref
from typing import Iterable, Sequence

from ...backend import Backend
from ...errors import ShardkitError
from ...handles import Group
from ...logs import logger
from ..policies import ShardingStrategy


class GroupMaker:
    """Creates one model's subgroups through its backend and remembers each, so they die with it."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.made: list[Group] = []

    def new_group(self, ranks: Sequence[int]) -> Group:
        """backend.collectives.new_group(ranks), remembered (every rank of the job calls it with the same ranks)."""
        group = self.backend.collectives.new_group(ranks)
        self.made.append(group)
        return group

    def release_with(self, owner: object) -> None:
        """Destroy the groups made so far once `owner` (the model's engine state) is collected."""
        if self.made:
            finalizer = weakref.finalize(owner, release_groups, self.backend, list(self.made))
            finalizer.atexit = False  # at exit, shutdown() (or the process's end) takes them all


def release_groups(backend: Backend, groups: list[Group]) -> None:
    """Destroy subgroups of a model that is gone; runs from a finalizer, so it never raises."""
    for group in groups:
        try:
            backend.collectives.destroy_group(group)
        except Exception as exc:  # noqa: BLE001 - a finalizer's exception would only be printed, mid-step
            logger.debug("could not destroy process group %s: %s", group.ranks, exc)


def solo_group(rank: int) -> Group:
    """The group of global rank `rank` alone (this rank's): no backend object, its collectives are local copies."""
    return Group(0, 1, (rank,), None)


def _make(maker: GroupMaker, ranks: Sequence[int], world: Group) -> Group:
    if len(ranks) == 1:
        return solo_group(ranks[0]) if world.ranks[world.rank] == ranks[0] else \
            Group(-1, 1, (ranks[0],), None)
    return maker.new_group(list(ranks))


def this_ranks_group(maker: GroupMaker, world: Group, families: Iterable[Sequence[int]]) -> Group:
    """Create every group of a family that covers the world and return the one holding this rank.

    Every rank calls this with the same family in the same order: new_group is collective.
    """
    me = world.ranks[world.rank]
    mine = None
    for ranks in families:
        group = _make(maker, ranks, world)
        if me in group.ranks:
            mine = group
    assert mine is not None, "the family covers every rank"
    return mine


def shard_group_size(strategy: ShardingStrategy, hybrid_group_size: int | None,
                     local_world_size: int, n: int) -> int:
    """How many ranks each shard group has under `strategy` in a world of `n` ranks (no groups made)."""
    if strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
        return n
    if strategy is ShardingStrategy.NO_SHARD:
        return 1
    k = hybrid_group_size or local_world_size or n
    if k < 1 or n % k:
        raise ShardkitError(
            f"HYBRID_SHARD needs the world size ({n}) to be a multiple of the shard group size ({k}); "
            "HINT: pass hybrid_group_size=<a divisor of the world size> to shardkit.shard() "
            "(`shardkit plan --hybrid-group-size N` on the command line)")
    return k


def make_groups(maker: GroupMaker, world: Group, strategy: ShardingStrategy,
                hybrid_group_size: int | None, local_world_size: int) -> tuple[Group, Group | None]:
    """Return (shard_group, replica_group) for this rank; every rank must call this together."""
    n = world.size
    if strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
        return world, None
    if strategy is ShardingStrategy.NO_SHARD:
        return solo_group(world.ranks[world.rank]), world
    k = shard_group_size(strategy, hybrid_group_size, local_world_size, n)
    shard = this_ranks_group(maker, world, [range(start, start + k) for start in range(0, n, k)])
    replica = this_ranks_group(maker, world, [range(offset, n, k) for offset in range(k)])
    return shard, replica


def make_node_hops(maker: GroupMaker, world: Group, shard_group: Group,
                   ranks_per_node: int | None) -> tuple[Group, Group] | None:
    """(this rank's node group, its group across nodes) inside a shard group spanning whole
    nodes, for the two-hop quantized gradient reduction; None where one hop is all there is.

    Every rank calls this together. Shard groups are runs of consecutive world ranks, so a node
    is a run of ranks_per_node of them and the group across nodes takes every ranks_per_node-th.
    """
    size, per_node, n = shard_group.size, ranks_per_node or 0, world.size
    if per_node < 2 or size <= per_node or size % per_node:
        return None
    node = this_ranks_group(maker, world, [range(start, start + per_node)
                                           for start in range(0, n, per_node)])
    across = this_ranks_group(maker, world, [range(first + offset, first + size, per_node)
                                             for first in range(0, n, size)
                                             for offset in range(per_node)])
    return node, across
