"""torch's own idioms on a sharded model give the unsharded model's answer or a clear error (issue 40).

Gradient clipping through torch.nn.utils (clip_grad_norm_ by attribute or imported before
shard(), get_total_norm + clip_grads_with_norm_, clip_grad_value_) clips by the whole model's norm
and trains like the unsharded model for 20 steps; state_dict()/load_state_dict() never move half
a model silently; parameters are DTensors of the whole shape, so p.numel() and p.shape count the
whole model, an EMA's full_tensor() is the whole average, and p.grad.norm().item() (this rank's part
of a sum) is refused naming .full_tensor(). See docs/coming-from.md.
"""

from __future__ import annotations

import math

import pytest
import torch

import shardkit
from _torch_idiom_workers import (STEPS, clip_run, conversion_run, lifecycle_run,
                                  other_world_run, state_dict_run)

pytestmark = pytest.mark.slow  # multi-process

TOL = 1e-5


def _check_clip(results: list[dict], how: str) -> None:
    for r in results:
        if how != "clip_grad_value_":
            assert math.isclose(r["norms"][0], r["gathered_norm"], rel_tol=1e-5)
            for ours, theirs in zip(r["norms"], r["ref_norms"]):
                assert math.isclose(ours, theirs, rel_tol=1e-5), (r["norms"], r["ref_norms"])
        assert r["param_diff"] <= 1e-4, r["param_diff"]
        assert r["grad_norm_log"] <= 1e-5
        assert r["ema_diff"] <= 1e-4
        assert r["counts"][0] == r["counts"][1] == r["counts"][2]  # p.numel(): the whole model
        assert r["shapes_whole"]
        if isinstance(r["bare_item"], str):  # a sharded parameter: refused, naming the fix
            assert "full_tensor()" in r["bare_item"] and "HINT" in r["bare_item"]
        else:  # whole parameters (NO_SHARD): torch's own value
            assert isinstance(r["bare_item"], float)
        if isinstance(r["to_vector"], str):
            assert "unevenly sharded" in r["to_vector"] and "redistribute" in r["to_vector"]
        else:
            assert r["to_vector"] <= 1e-5
    # The global loss (mean over the ranks' equal batches) is the unsharded model's, every step.
    for step in range(STEPS):
        mean = sum(r["losses"][step] for r in results) / len(results)
        assert abs(mean - results[0]["ref_losses"][step]) <= 1e-4, step


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("how", ["clip_grad_norm_", "imported_early", "get_total_norm",
                                 "clip_grad_value_"])
def test_torch_gradient_clipping_sees_the_whole_model(world, how):
    results = shardkit.spawn(clip_run, world, world, how, 2.0, threads_per_rank=1)
    _check_clip(results, how)
    if how != "clip_grad_value_":
        # The test can fail: torch's own function on a rank's rows gives a smaller norm.
        assert all(r["rows_norm"] < 0.99 * r["norms"][0] for r in results)


@pytest.mark.parametrize("norm_type", [1.0, float("inf"), 0.0])
def test_other_norm_orders_match_torch_on_the_unsharded_model(norm_type):
    results = shardkit.spawn(clip_run, 2, 2, "clip_grad_norm_", norm_type, threads_per_rank=1)
    _check_clip(results, "clip_grad_norm_")


@pytest.mark.parametrize("strategy, world, hybrid, kwargs", [
    ("SHARD_GRAD_OP", 2, None, {}),
    ("NO_SHARD", 2, None, {}),
    ("FULL_SHARD", 2, None, {"cpu_offload": True}),
    pytest.param("HYBRID_SHARD", 4, 2, {}, marks=pytest.mark.long),
    pytest.param("FULL_SHARD", 4, None, {"reshard_after_forward": 2}, marks=pytest.mark.long)])
def test_clipping_matches_under_every_strategy(strategy, world, hybrid, kwargs):
    results = shardkit.spawn(clip_run, world, world, "clip_grad_norm_", 2.0, strategy, hybrid,
                             kwargs, threads_per_rank=1)
    _check_clip(results, "clip_grad_norm_")


def test_clipping_under_mixed_precision_uses_the_whole_master_gradients():
    mp = shardkit.MixedPrecision(param_dtype=torch.bfloat16)
    results = shardkit.spawn(clip_run, 2, 2, "clip_grad_norm_", 2.0, "FULL_SHARD", None,
                             {"mixed_precision": mp}, threads_per_rank=1)
    for r in results:
        # bf16 compute moves the gradients away from the fp32 reference's: the independent
        # answer is torch's own norm of the gathered (whole, fp32 master) gradients.
        assert math.isclose(r["norms"][0], r["gathered_norm"], rel_tol=1e-5)
        assert r["rows_norm"] < 0.99 * r["norms"][0]
        assert math.isclose(r["norms"][0], r["ref_norms"][0], rel_tol=2e-2)


def test_torch_norm_function_is_put_back_at_shutdown():
    for r in shardkit.spawn(lifecycle_run, 2, 2, threads_per_rank=1):
        assert r["replaced"] and r["restored"] and r["public_restored"]
        assert r["plain_same"]
        # A vendor's own clip_grad_norm_ (torch_xla replaces torch's) stays for plain tensors.
        assert r["vendor_whole"] and r["vendor_calls"] == 1 and r["vendor_restored"]
        assert "norm_type" in r["negative"] and "HINT" in r["negative"]


@pytest.mark.parametrize("world, other", [(2, 3), (3, 2)])
def test_state_dict_never_moves_half_a_model_silently(tmp_path, world, other):
    results = shardkit.spawn(state_dict_run, world, world, str(tmp_path), threads_per_rank=1)
    for rank, r in enumerate(results):
        assert len(r["warnings"]) == 2 and "full_state_dict" in r["warnings"][0], r["warnings"]
        assert "checkpoint.export(dir, model)" in r["warnings"][0]
        assert r["quiet_routes_warned"] == []  # torch's get_model_state_dict, full_state_dict
        if rank == 0:
            assert r["rank0_rows"] == "loaded"
        else:
            assert f"shard 0 of {world}" in r["rank0_rows"] and f"shard {rank} of {world}" in r["rank0_rows"]
        assert r["own_rows_diff"] == 0.0
        assert "DTensor" in r["into_unsharded"]  # an unsharded model refuses the DTensor dict
        for name in ("torch_full", "gathered_full"):
            diff, missing, unexpected = r[name]
            assert diff == 0.0 and missing == [] and unexpected == [], (name, r[name])
        assert "HINT" in r["bad_shape"] and "has shape" in r["bad_shape"]
        assert "assign=True" in r["assign"]
    for r in shardkit.spawn(other_world_run, other, other, str(tmp_path), threads_per_rank=1):
        assert r["full_diff"] == 0.0
        assert f"of {world}" in r["rows"] and f"of {other}" in r["rows"] and "HINT" in r["rows"]


def test_a_dtype_or_device_change_after_shard_is_refused_and_changes_nothing():
    for r in shardkit.spawn(conversion_run, 2, 2, threads_per_rank=1):
        assert "MixedPrecision(param_dtype=torch.bfloat16)" in r["to_bf16"], r["to_bf16"]
        assert "MixedPrecision(param_dtype=torch.float16)" in r["half"]
        assert "float64" in r["double"] and "HINT" in r["double"]
        assert "cpu_offload=True" in r["meta"]
        assert r["dtypes"] == ["torch.float32"]
        assert r["grad_diff"] <= 1e-6
