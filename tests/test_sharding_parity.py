"""Sharded training equals unsharded training on the concatenated batch, for every strategy.

World sizes 1, 2, 3 (uneven shards: TinyNet's 3607 parameters pad to 3639 over 3 ranks) and 4
(HYBRID_SHARD in groups of 2). Each world size is one spawn shared with the other sharding test
files (tests/_sharding_workers.spawn_suite).
"""

from __future__ import annotations

import pytest

from _models import TinyNet
from _sharding_workers import spawn_suite

pytestmark = pytest.mark.slow  # multi-process: runs by default, skipped by -m 'not slow'

TOL = 1e-5  # fp32 AdamW; observed differences are ~5e-7 (summation order of the gradient mean)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_parity_every_strategy_after_every_step(world):
    expected = {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"} | ({"HYBRID_SHARD"} if world == 4 else set())
    for rank, result in enumerate(spawn_suite(world)):
        assert set(result["parity"]) == expected
        for strategy, run in result["parity"].items():
            assert run["init_diff"] == 0.0
            assert len(run["diffs"]) == 5
            assert max(run["diffs"]) <= TOL, (world, rank, strategy, run["diffs"])


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_parity_with_direct_collectives_forced_on_and_off(world):
    """Capabilities.direct_collective_numel=1 (every param gathered into its own storage and
    reduced from its own grad) trains like the reference, also without storage resize (2 ranks);
    forced off (None) buckets exactly as the plain parity runs above do, on the cpu backend's
    default (no TinyNet param reaches it)."""
    shapes = [p.shape for p in TinyNet().parameters()]
    for rank, result in enumerate(spawn_suite(world)):
        runs = result["direct"]
        assert runs["default_direct_buckets"] == runs["off_direct_buckets"] == 0
        assert runs["on_direct_buckets"] == len(shapes)
        # A grad is its own reduce input when its param needs no padding rows; the others are packed.
        assert runs["on_grads_as_inputs"] == sum(s[0] % world == 0 for s in shapes)
        for name, run in runs["on"].items():
            diffs = run if name == "mixed_precision" else run["diffs"]
            if name != "mixed_precision":
                assert run["init_diff"] == 0.0
            assert len(diffs) == 5
            assert max(diffs) <= TOL, (world, rank, name, diffs)


def test_hybrid_shard_groups_and_accumulation():
    for result in spawn_suite(4):
        assert result["hybrid_info"] == {"world_size": 4, "strategy": "HYBRID_SHARD",
                                         "shard_group_size": 2, "replica_group_size": 2}
        run = result["hybrid_no_sync"]
        assert max(run["diffs"]) <= TOL
        # one reduce-scatter (inside the pair) and one all-reduce (across pairs) per unit per step
        assert run["rs_calls"] == run["ar_calls"] == 5 * 3
