"""Parameters are DTensors of the whole parameter: edges the plain-rows engine never had (issue 40).

A 0-d parameter is Replicate() and every rank holds the same value; a parameter with fewer rows
than ranks leaves some ranks with no local rows. Trained with torch's own clip_grad_norm_ (2 and
inf norms, the scalar counted once) and AdamW, the model equals the unsharded one; its checkpoint
loads at another world size; torch.save of state_dict() loads back through torch.load's default
weights_only=True.
"""

from __future__ import annotations

import pytest

import shardkit
from _whole_param_workers import load_run, placements_expected, state_dict_file_run, train_run

pytestmark = pytest.mark.slow  # multi-process


def _check_training(results: list[dict], world: int, hybrid: int | None) -> None:
    for r in results:
        assert r["placements"] == placements_expected(world, hybrid)
        assert r["numel"][0] == r["numel"][1]
        for ours, theirs in zip(r["norms"], r["ref_norms"]):
            assert abs(ours - theirs) <= 1e-5 * max(1.0, theirs), (r["norms"], r["ref_norms"])
        for ours, theirs in zip(r["losses"], r["ref_losses"]):
            assert abs(ours - theirs) <= 1e-5, (r["losses"], r["ref_losses"])
        assert r["param_diff"] <= 1e-5 and r["state_diff"] <= 1e-5
        assert r["temperature_copies_equal"]


@pytest.mark.parametrize("world, other", [(2, 3), (3, 2)])
def test_scalar_and_rowless_parameters_train_like_unsharded_and_reshard(tmp_path, world, other):
    ckpt = str(tmp_path / "ckpt")
    results = shardkit.spawn(train_run, world, world, "FULL_SHARD", None, ckpt, threads_per_rank=1)
    _check_training(results, world, None)
    if world == 3:  # the (2, 16) weight and the 1-element bias: rank 2 holds no rows of either
        assert results[2]["local_rows"]["proj.weight"] == (0, 16)
        assert results[2]["local_rows"]["shift"] == (0,)
    assert all(r["local_rows"]["temperature"] == () for r in results)
    for r in shardkit.spawn(load_run, other, other, ckpt, threads_per_rank=1):
        assert r["param_diff"] == 0.0
        assert r["state_types"] == ["DTensor"]
        assert r["temperature_copies_equal"]


@pytest.mark.long
def test_hybrid_mesh_has_a_replicate_dimension():
    results = shardkit.spawn(train_run, 4, 4, "HYBRID_SHARD", 2, None, threads_per_rank=1)
    _check_training(results, 4, 2)


@pytest.mark.parametrize("world, strategy, hybrid", [(1, "FULL_SHARD", None), (2, "NO_SHARD", 1),
                                                   (2, "HYBRID_SHARD", 1)])
def test_one_rank_shard_groups_hold_replicated_dtensors_that_train_like_unsharded(world, strategy,
                                                                                 hybrid):
    # One parameter form (issue 52): a world of one, NO_SHARD and one-rank HYBRID groups give
    # DTensors too, Replicate() over the world, whose local tensor is the whole parameter.
    results = shardkit.spawn(train_run, world, world, strategy, hybrid if strategy != "NO_SHARD"
                             else None, None, threads_per_rank=1)
    _check_training(results, world, hybrid)
    for r in results:
        assert set(r["types"].values()) == {"DTensor"}, r["types"]
        assert r["local_rows"] == r["full_shapes"]
        assert r["local_step"]  # torch's AdamW stepped the local tensors, as at N ranks


def test_state_dict_file_loads_back_with_torch_load_defaults(tmp_path):
    for r in shardkit.spawn(state_dict_file_run, 3, 3, str(tmp_path), threads_per_rank=1):
        assert r["types"] == ["DTensor"] and r["diff"] == 0.0
