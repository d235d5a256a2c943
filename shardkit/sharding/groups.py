"""Build each strategy's shard group and replicate group from the world group."""

from __future__ import annotations

from ..backend import Backend
from ..errors import ShardkitError
from ..handles import Group
from .policies import ShardingStrategy


def _solo(world: Group) -> Group:
    # A group of just this rank needs no backend object: collectives of size 1 are local copies.
    return Group(0, 1, (world.ranks[world.rank],), None)


def _make(backend: Backend, ranks: range, world: Group) -> Group:
    if len(ranks) == 1:
        return Group(0, 1, (ranks[0],), None) if world.ranks[world.rank] == ranks[0] else \
            Group(-1, 1, (ranks[0],), None)
    return backend.new_group(list(ranks))


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


def make_groups(backend: Backend, world: Group, strategy: ShardingStrategy,
                hybrid_group_size: int | None, local_world_size: int) -> tuple[Group, Group | None]:
    """Return (shard_group, replica_group) for this rank; every rank must call this together."""
    n = world.size
    if strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
        return world, None
    if strategy is ShardingStrategy.NO_SHARD:
        return _solo(world), world
    k = shard_group_size(strategy, hybrid_group_size, local_world_size, n)
    me = world.ranks[world.rank]
    shard = replica = None
    # Every rank creates every group in the same order (new_group is collective).
    for start in range(0, n, k):
        g = _make(backend, range(start, start + k), world)
        if me in g.ranks:
            shard = g
    for offset in range(k):
        g = _make(backend, range(offset, n, k), world)
        if me in g.ranks:
            replica = g
    assert shard is not None  # the shard groups cover every rank
    return shard, replica
