"""Sharded training equals unsharded training on the concatenated batch, for every strategy."""

from __future__ import annotations

import pytest

import shardkit

from _sharding_workers import parity_run

TOL = 1e-5  # fp32; observed differences are ~5e-7 (summation order of the gradient mean)
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")


def _all_strategies(rank: int, world: int) -> dict[str, list[float]]:
    return {s: parity_run(rank, s, world) for s in STRATEGIES}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_parity_every_strategy(world):
    results = shardkit.spawn(_all_strategies, world, world, threads_per_rank=1)
    for rank, per_strategy in enumerate(results):
        for strategy, diffs in per_strategy.items():
            assert len(diffs["diffs"]) == 5
            assert max(diffs["diffs"]) <= TOL, (world, rank, strategy, diffs)
