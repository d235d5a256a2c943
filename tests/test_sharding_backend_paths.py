"""Backend-dependent code paths, driven by capabilities (not names): a gloo backend declaring no
storage resize, synchronous collectives, compiler barriers and 4-element alignment (what a
lazy-tensor device such as XLA declares) must train exactly like the unsharded reference."""

from __future__ import annotations

import math

import pytest

import shardkit

from _sharding_workers import LazyLikeCPU, lazy_like_suite

pytestmark = pytest.mark.slow  # multi-process: runs by default, skipped by -m 'not slow'


def test_no_storage_resize_sync_collectives_barriers_and_alignment():
    results = shardkit.spawn(lazy_like_suite, 2, 2, backend=LazyLikeCPU(), threads_per_rank=1)
    for r in results:
        assert r["backend"] == "cpu-lazy-like"
        for run in [*r["parity"].values(), r["no_sync"], r["meta"]]:
            assert run["init_diff"] == 0.0 and max(run["diffs"]) <= 1e-5
        assert r["unshard"]["out_diff"] == 0.0 and r["unshard"]["sharded_after"]
        # Alignment 4 adds whole rows while that costs under 4 elements (so 1-D shards are
        # always multiples of 4, as flat shards were); wider rows stay at ceil(rows / 2).
        padded_by_alignment = 0
        for shape, shard_numel in r["shard_sizes"]:
            rows, row = shape[0], math.prod(shape[1:])
            plain = -(-rows // 2)
            aligned = next(k for k in range(plain, plain + 5) if k * row % 4 == 0)
            want = aligned if (aligned - plain) * row < 4 else plain
            assert shard_numel == want * row, (shape, shard_numel)
            padded_by_alignment += want != plain
        assert padded_by_alignment > 0
        assert r["barriers"] > 0
