"""After shard(), parameters keep their dimensions (dim-0 row shards), so training code keyed on
shapes trains as it does unsharded: nanoGPT's and transformers' weight-decay rules, a Muon-style
optimizer on whole matrices through shardkit.full_tensor / local_shard, and checkpoints written
while shards were 1-D still load (tests/fixtures/flat_shard_ckpt, made by the script beside it).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import shardkit
from _optim_state import assemble_optim
from _param_shape_workers import decay_rule_run, expected_legacy, legacy_checkpoint_run, muon_run

pytestmark = pytest.mark.slow  # multi-process

TOL = 1e-5


@pytest.mark.parametrize("rule", ["nanogpt", "hf"])
def test_weight_decay_rules_pick_the_same_groups_and_train_like_unsharded(rule):
    if rule == "hf" and importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed (pip install '.[hf]')")
    results = shardkit.spawn(decay_rule_run, 2, 2, rule, threads_per_rank=1)
    for r in results:
        assert r["dims"] == r["ref_dims"]
        assert r["names"] == r["ref_names"] and all(r["names"])  # both groups non-empty
        assert max(r["diffs"]) <= TOL, r["diffs"]
    # Global loss (the ranks' mean over equal halves of the batch) equals the reference's.
    for step in range(len(results[0]["losses"])):
        mean = sum(r["losses"][step] for r in results) / len(results)
        assert abs(mean - results[0]["ref_losses"][step]) <= 1e-5
    # The test can fail: losing the decay (what 1-D shards did) moves the weights this much.
    assert results[0]["decay_effect"] > 100 * TOL


@pytest.mark.parametrize("world, strategy, hybrid", [(2, "FULL_SHARD", None),
                                                     (3, "FULL_SHARD", None),
                                                     pytest.param(4, "HYBRID_SHARD", 2,
                                                                  marks=pytest.mark.long)])
def test_muon_style_optimizer_on_whole_matrices_matches_unsharded(world, strategy, hybrid):
    results = shardkit.spawn(muon_run, world, world, strategy, hybrid, threads_per_rank=1)
    for r in results:
        assert r["full_shape_ok"] and r["local_shape_ok"] and r["plain_passthrough"]
        assert r["full_shape_sends"] == 0  # full_shape is local
        assert r["roundtrip"]
        assert max(r["grad_diffs"]) <= TOL, r["grad_diffs"]
        assert max(r["diffs"]) <= 1e-4, r["diffs"]
        assert "shape (3,)" in r["full_tensor"] and "HINT" in r["full_tensor"]
        assert "full shape is (5, 14)" in r["local_shard"]


@pytest.mark.parametrize("world", [2, 3])
def test_checkpoint_written_with_one_dim_shards_still_loads(world):
    expected = expected_legacy()
    results = shardkit.spawn(legacy_checkpoint_run, world, world, threads_per_rank=1)
    full_optim, steps = assemble_optim([r["optim"] for r in results])
    assert steps == expected["steps"]
    assert full_optim.keys() == expected["optim"].keys()
    for key, value in expected["optim"].items():
        assert torch.equal(full_optim[key], value), key
    for r in results:
        assert r["extra"] == {"step": 2}
        assert r["state_shapes_ok"]  # the 1-D state was put back in the shards' shapes
        assert r["params"].keys() == expected["params"].keys()
        assert all(torch.equal(r["params"][k], v) for k, v in expected["params"].items())
        assert r["after_step"] <= TOL
