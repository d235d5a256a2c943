"""Users' own collectives (model.set_custom_all_gather / set_custom_reduce_scatter, FSDP2's
interface): called exactly where the built-in ones are (the backend's own calls noted in the same
run), the same bytes and bit-identical weights for a pass-through comm, training beside the
unsharded model, the same calls as torch's fully_shard with the same comm objects, and misuse
refused with what to do."""

from __future__ import annotations

import pytest

import shardkit

from _custom_comm_workers import beside_fsdp2, parity, refusals, where_called

STEPS = 3


@pytest.mark.parametrize("strategy, extra", [
    ("FULL_SHARD", {}),
    ("SHARD_GRAD_OP", {"prefetch": 2}),
])
def test_custom_comms_are_called_exactly_where_the_built_in_ones_are(strategy, extra):
    for r in shardkit.spawn(where_called, 2, 2, strategy, extra, threads_per_rank=1):
        # Same calls in the same order: sizes, dtype, async (overlap) flag; SUM for the scatter
        # (gloo has no exact average: the built-in also sums and divides after).
        assert r["gather_calls"] and r["gather_calls"] == r["builtin_gathers"]
        assert [c[:3] for c in r["scatter_calls"]] == [c[:3] for c in r["builtin_scatters"]]
        assert {c[3] for c in r["scatter_calls"]} == {"ReduceOp.SUM"} or \
            {c[3] for c in r["scatter_calls"]} == {"RedOpType.SUM"}
        assert r["stats_equal"]  # the bytes each step counts
        assert r["weights_equal"]  # a pass-through comm changes nothing, bit for bit
        assert not r["called_after_none"]  # None: the built-in again
        assert r["comm_freed"]  # nothing keeps the comm once the model is gone


@pytest.mark.parametrize("strategy, extra", [
    ("FULL_SHARD", {"reshard_after_forward": 2, "prefetch": 2}),
    ("HYBRID_SHARD", {"hybrid_group_size": 2}),
])
def test_training_with_custom_comms_matches_the_unsharded_model(strategy, extra):
    for r in shardkit.spawn(parity, 4, 4, strategy, extra, threads_per_rank=1):
        assert r["gathers"] > 0 and r["scatters"] > 0
        assert max(r["diffs"]) < 1e-5, r["diffs"]


def test_the_same_comm_objects_see_the_same_calls_as_under_torch_fully_shard():
    for r in shardkit.spawn(beside_fsdp2, 2, 2, threads_per_rank=1):
        # 5 all-gathers (the root kept from forward to backward, as FSDP2's) and 3
        # reduce-scatters of the same sizes a step.
        assert len(r["shardkit"][0]) == 5 and len(r["shardkit"][1]) == 3
        assert r["shardkit"] == r["fsdp2"], r


def test_misuse_is_refused_saying_what_to_do():
    said = shardkit.spawn(refusals, 2, 2, threads_per_rank=1)[0]
    assert "has no allocate(size, *, dtype, device)" in said["not_a_comm"]
    assert "as torch's FSDP2 AllGather has" in said["not_a_comm"]
    assert "has no allocate(size, *, dtype, device) and no __call__" in said["scatter_not_a_comm"]
    assert "Quantization(weights=True)" in said["quantized_gather"]
    assert "Quantization(gradients=True)" in said["quantized_scatter"]
    assert "during a step" in said["mid_step"] and "HINT: call it between steps" in said["mid_step"]
    assert said["between_steps"] is None
