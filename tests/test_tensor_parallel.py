"""Tensor parallel inside, shardkit across: torchtitan's Llama TP plan (`parallelize_module` on
mesh["tp"]: colwise / rowwise projections, SequenceParallel norms, loss_parallel), then
`shardkit.shard(model, mesh=mesh["dp"])`.

Each case trains a tiny Llama-style model three ways in one run: shardkit + TP, FSDP2 + the same
TP plan (`fully_shard(mesh=mesh["dp"])`), and the one-process model on the global batch; torch's
own `clip_grad_norm_` clips every step (its norm spans both dimensions), and the weights are
compared through torch's state-dict API (`get_model_state_dict(full_state_dict=True)`).
"""

from __future__ import annotations

import pytest

import shardkit

from _tp_workers import tp_beside_plain_layers, tp_checkpoints, tp_dp, tp_refusals, tp_uneven


def _close(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.long
@pytest.mark.parametrize("world, strategy, steps, options", [
    (4, "FULL_SHARD", 20, {}),
    (4, "SHARD_GRAD_OP", 6, {"micro": 2}),  # the first micro-batch under no_sync
    (4, "FULL_SHARD", 6, {"checkpointing": True}),  # shardkit.wrap.checkpoint_layers
    # (the peer: FSDP2's FULL_SHARD, the same arithmetic). CI: NO_SHARD on a user's mesh
    # (test_user_mesh.py) and the TP cases here; extended for CI's 90 minutes.
    pytest.param(4, "NO_SHARD", 6, {}, marks=pytest.mark.extended),
    (4, "FULL_SHARD", 4, {"compile": "eager"}),  # block.compile(): dynamo (see below for AOT)
    (8, "HYBRID_SHARD", 6, {}),  # 2 replicas x 2 ranks per shard group x TP 2
])
def test_tp_inside_shardkit_across_trains_as_one_process_and_as_fsdp2_with_the_same_plan(
        world, strategy, steps, options):
    for r in shardkit.spawn(tp_dp, world, world, strategy, steps, options, threads_per_rank=1):
        dims = ("dp_replicate", "dp_shard", "tp") if strategy == "HYBRID_SHARD" else ("dp", "tp")
        assert r["meshes"] == [dims], "every parameter is a DTensor on data parallel x TP"
        replicas = "Replicate(), " if strategy == "HYBRID_SHARD" else ""
        # Rows of TP's part where TP splits dim 0 (colwise, the embedding): _StridedShard, as FSDP2.
        strided, rows = "_StridedShard(dim=0, sf=2)", "Shard(dim=0)"
        if strategy == "NO_SHARD":
            strided = rows = "Replicate()"
        assert r["placements"] == {
            "tok_embeddings.weight": f"({replicas}{strided}, Shard(dim=0))",
            "layers.0.attention.wq.weight": f"({replicas}{strided}, Shard(dim=0))",
            "layers.0.attention.wo.weight": f"({replicas}{rows}, Shard(dim=1))",
            "norm.weight": f"({replicas}{rows}, Replicate())"}
        ours, theirs, ref = r["shardkit"], r["fsdp2"], r["reference"]
        assert _close(ours["losses"], ref["losses"]) < 1e-5, (ours["losses"], ref["losses"])
        assert _close(theirs["losses"], ref["losses"]) < 1e-5  # the peer agrees with the reference
        # torch's clip_grad_norm_ over both dimensions: the whole model's norm, every step.
        assert _close(ours["norms"], ref["norms"]) < 1e-5, (ours["norms"], ref["norms"])
        # As close to the one-process model as FSDP2 with the same TP plan gets, and to FSDP2.
        assert r["vs_reference"] <= 1.2 * r["fsdp2_vs_reference"] + 1e-6, r
        assert r["vs_fsdp2"] < 1e-5, r
        assert r["freed"], "a deleted 2-D model is freed"


@pytest.mark.extended  # CI: the dynamo-compiled case above
def test_tp_blocks_compiled_through_aot_autograd_give_fsdp2s_numbers_which_lose_a_gradient():
    # torch 2.13 (CPU): a TP block compiled with an AOTAutograd backend (aot_eager, inductor)
    # drops the gradient into the block's input. Under FSDP2 and shardkit alike the embedding's
    # gradient is then zero (every other parameter's exact); with TP alone (no data parallelism)
    # backward raises "'Tensor' object has no attribute '_local_tensor'" in DTensor's
    # redistribute. shardkit gives FSDP2's numbers, bit for bit; this pins torch's behaviour
    # (docs/guide/tensor-parallel.md says so) so that a torch that fixes it is noticed.
    for r in shardkit.spawn(tp_dp, 4, 4, "FULL_SHARD", 4, {"compile": "aot_eager"},
                            threads_per_rank=1):
        assert r["vs_fsdp2"] == 0.0, r
        assert r["vs_reference"] > 1e-3 and r["fsdp2_vs_reference"] > 1e-3, r


@pytest.mark.extended  # CI: bf16 mixed precision's parity (test_sharding_*), TP's cases above
def test_tp_with_bf16_mixed_precision_matches_fsdp2_with_the_same_policy():
    for r in shardkit.spawn(tp_dp, 4, 4, "FULL_SHARD", 6, {"mp": True}, threads_per_rank=1):
        # bf16 compute: the one-process fp32 model is only near; FSDP2's bf16 run is the peer.
        assert r["vs_fsdp2"] < 1e-6, r
        assert _close(r["shardkit"]["losses"], r["fsdp2"]["losses"]) < 1e-6
        assert _close(r["shardkit"]["losses"], r["reference"]["losses"]) < 0.05


@pytest.mark.extended  # CI: int reshard on a user's mesh (test_user_mesh.py), TP's cases above
def test_tp_with_an_int_reshard_after_forward_trains_as_one_process():
    # TP 2 x DP 4, each unit keeping 1/2 of its gathered parameters after forward: the 2-rank
    # blocks are cut from each TP rank's data-parallel group (they stride across the world).
    for r in shardkit.spawn(tp_dp, 8, 8, "FULL_SHARD", 6, {"reshard": 2}, threads_per_rank=1):
        assert _close(r["shardkit"]["losses"], r["reference"]["losses"]) < 1e-5
        assert _close(r["shardkit"]["norms"], r["reference"]["norms"]) < 1e-5
        assert r["vs_reference"] < 5e-5, r


@pytest.mark.long
def test_layers_tp_leaves_plain_are_replicated_over_tp_on_the_same_mesh():
    # The guide's recipe: TP on each block's MLP, the first and last Linear and the norms plain.
    # Every parameter lives on one (dp, tp) mesh, so torch's clip_grad_norm_ (a foreach op over
    # all gradients) runs, and the plain ones are Replicate() over TP.
    for r in shardkit.spawn(tp_beside_plain_layers, 4, 4, threads_per_rank=1):
        assert r["meshes"] == {("dp", "tp")}
        assert r["placements"] == ["(Shard(dim=0), Replicate())", "(Shard(dim=0), Shard(dim=1))",
                                   "(_StridedShard(dim=0, sf=2), Shard(dim=0))"]
        assert max(abs(a - b) for a, b in r["norms"]) < 1e-5, r["norms"]
        assert r["vs_reference"] < 1e-5, r


@pytest.mark.long
def test_a_tp_checkpoint_loads_at_every_layout_and_fsdp2s_both_ways(tmp_path):
    # Saved at TP 2 x DP 2 (model + AdamW, in the background): each rank's piece is a block of
    # the whole tensor (rows of TP's part), which DCP reshards on load.
    results = shardkit.spawn(tp_checkpoints, 4, 4, str(tmp_path), threads_per_rank=1)
    for r in results:
        for where in ("into_dp4", "into_tp4", "fsdp2_into_shardkit", "shardkit_into_fsdp2"):
            assert r[where] == 0.0, (where, r)
        assert r["resumed"] == r["continued"], r  # the optimizer's state came back too
    assert results[0]["full_state_dict"] == 0.0
    assert results[0]["into_one_process"] == 0.0  # consolidated to safetensors, loaded unsharded


@pytest.mark.extended  # CI: the layout check in shard() runs in every TP case above
def test_widths_that_split_unevenly_over_tp_and_dp_are_laid_out_as_torchs_dtensor():
    # 13, 5, 3 and 1 rows over TP 2 x DP 2: short and empty pieces, read back whole exactly.
    for r in shardkit.spawn(tp_uneven, 4, 4, threads_per_rank=1):
        assert max(r.values()) == 0.0, r


def test_a_tensor_parallel_model_is_refused_where_shardkit_does_not_handle_it_yet():
    said = shardkit.spawn(tp_refusals, 2, 2, threads_per_rank=1)[0]
    assert "is already a DTensor" in said["no_mesh"] and "pass mesh=mesh['dp']" in said["no_mesh"]
    assert "are not two dimensions of one mesh over the job's 2 ranks" in said["overlapping_meshes"]
    assert "=2 must divide the shard group size 1" in said["reshard_wider_than_dp"]
    for name, setting in (("sync", "sync_module_states=True"), ("quantize", "quantize=")):
        assert said[name].startswith(f"{setting} with a tensor-parallel model"), said[name]
        assert "not supported yet" in said[name]
    assert said["full_shape"] == (64, 32)  # TP's global shape, not this rank's part
    # Whole tensors read by this rank's rows alone would fill a TP part with the wrong rows.
    assert "into a tensor-parallel parameter ('tok_embeddings.weight'" in said["full_state_dict_in"]
    assert "set_model_state_dict" in said["full_state_dict_in"]
    assert "distribute_tensor(full, p.device_mesh, p.placements" in said["local_shard"]
    assert "pass the DTensor" in said["full_tensor_plain"]
    assert said["full_tensor_dtensor"] == (64, 32)
