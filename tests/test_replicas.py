"""After shard(), every replica of every parameter and buffer is equal, or shard() said why not.

Ranks that build their model from different seeds (or draw from torch's RNG a rank-dependent
number of times before building) are refused, naming the first differing tensor and the fix;
sync_module_states=True copies rank 0's values instead (also when materialising from meta);
FULL_SHARD, where ranks own disjoint rows, only needs its buffers equal. check_replicas finds
drift after shard(). (The XLA thread case is in test_xla_lane.py.)
"""

from __future__ import annotations

import functools

import pytest

import shardkit
from _replica_workers import drift_case, replica_case, sync_trains_like_rank0

pytestmark = pytest.mark.slow  # multi-process

DIFFERENT = [0, 1, 2, 3]
UNSEEDED = [None] * 4


def run(world, *args, **kwargs):
    return shardkit.spawn(functools.partial(replica_case, **kwargs), world, world, *args,
                          threads_per_rank=1)


@pytest.mark.parametrize("world, seeds", [(2, DIFFERENT), (3, DIFFERENT), (2, UNSEEDED)])
def test_no_shard_replicas_built_differently_are_refused_on_every_rank(world, seeds):
    for r in run(world, "NO_SHARD", seeds[:world]):
        err = r["error"]
        assert err and "'inp.weight'" in err and f"ranks {list(range(world))} must hold" in err
        assert f"but ranks {list(range(1, world))} hold other values than rank 0" in err
        assert "sync_module_states=True" in err and "shardkit.seeded" in err


def test_hybrid_shard_replica_groups_built_differently_are_refused_on_every_rank():
    # Shard groups {0,1} {2,3}, replica groups {0,2} {1,3}: only rank 3 built another model, so
    # only the replicas of the rows ranks 1 and 3 hold differ; ranks 0 and 2 must stop too.
    results = run(4, "HYBRID_SHARD", [0, 0, 0, 3], hybrid=2)
    for rank in (1, 3):
        assert "ranks [1, 3] must hold the same parameter" in results[rank]["error"]
        assert "but ranks [3] hold other values than rank 1" in results[rank]["error"]
    for rank in (0, 2):
        assert "another replica group" in results[rank]["error"]


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=[pytest.mark.slow, pytest.mark.long])])
def test_full_shard_ranks_own_disjoint_rows_so_different_inits_pass(world):
    for r in run(world, "FULL_SHARD", DIFFERENT[:world]):
        assert r["error"] is None  # one consistent model of every rank's own rows
    for r in run(world, "FULL_SHARD", [0] * world):
        assert r["error"] is None and r["diff_to_rank0"] == 0.0


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_a_buffer_differing_on_one_rank_is_refused(strategy):
    for r in run(2, strategy, [0, 0], skew_buffer=True):
        assert "same buffer 'bn.running_mean'" in r["error"] and "but ranks [1] hold" in r["error"]


@pytest.mark.parametrize("world, strategy, hybrid, meta", [
    (2, "NO_SHARD", None, False), (3, "FULL_SHARD", None, False),
    (4, "HYBRID_SHARD", 2, False), (2, "NO_SHARD", None, True), (3, "FULL_SHARD", None, True)])
def test_sync_module_states_gives_rank_0s_model_everywhere(world, strategy, hybrid, meta):
    for r in run(world, strategy, DIFFERENT[:world], sync=True, hybrid=hybrid, meta=meta,
                 skew_buffer=True):
        assert r["error"] is None
        assert r["diff_to_rank0"] == 0.0
        assert all(r["buffers"][n].equal(b) for n, b in r["ref_buffers"].items())


@pytest.mark.parametrize("strategy", ["NO_SHARD", "FULL_SHARD"])
def test_synced_ranks_train_like_rank_0s_model(strategy):
    for r in shardkit.spawn(sync_trains_like_rank0, 2, 2, strategy, threads_per_rank=1):
        assert max(r["diffs"]) <= 1e-6, r["diffs"]


def test_check_replicas_finds_drift_after_shard_and_a_child_of_a_sharded_model_is_refused():
    for r in shardkit.spawn(drift_case, 2, 2, threads_per_rank=1):
        assert r["clean"] is None
        assert "'out.weight'" in r["param"] and "but ranks [1] hold" in r["param"]
        assert "same buffer 'bn.running_var'" in r["buffer"] and "but ranks [1] hold" in r["buffer"]
        assert "already belongs to a sharded model" in r["child"]
