"""shard(model, mesh=...): a user's DeviceMesh for the data-parallel dimensions, as FSDP2's mesh=.

Each case trains the same model three ways in one run: shardkit on the user's mesh, shardkit on
its own groups (the same numbers, bit for bit: the same collectives on equal groups), and torch's
own engine on that mesh (fully_shard; HSDP on a 2-D mesh; DDP for NO_SHARD), and once more
beside the unsharded model on the global batch; torch's state dict of it loads into torch's
engine on the same mesh. Misuse is refused with what to do.
"""

from __future__ import annotations

import pytest

import shardkit

from _mesh_workers import on_a_mesh, refusals


@pytest.mark.parametrize("strategy, world, extra", [
    ("FULL_SHARD", 2, {}),
    # CI: FULL_SHARD here and SHARD_GRAD_OP beside TP (test_tensor_parallel.py); NO_SHARD's
    # groups come from the same mesh dimension. Extended for CI's 90 minutes.
    pytest.param("SHARD_GRAD_OP", 2, {}, marks=pytest.mark.extended),
    pytest.param("NO_SHARD", 2, {}, marks=pytest.mark.long),
    pytest.param("HYBRID_SHARD", 4, {}, marks=pytest.mark.long),
    pytest.param("FULL_SHARD", 4, {"reshard_after_forward": 2}, marks=pytest.mark.long),
])
def test_a_mesh_over_every_rank_trains_as_shardkits_own_groups_and_as_torch_on_that_mesh(
        strategy, world, extra):
    for r in shardkit.spawn(on_a_mesh, world, world, strategy, extra, threads_per_rank=1):
        # No group of shardkit's own but reshard_after_forward=2's block holding this rank.
        assert r["groups_made"] == (1 if "reshard_after_forward" in extra else 0)
        assert r["on_the_mesh"], "every parameter is a DTensor on the user's mesh"
        if strategy == "NO_SHARD":
            assert r["placements"] == ["(Replicate(),)"]
        elif strategy == "HYBRID_SHARD":
            assert r["placements"] == ["(Replicate(), Shard(dim=0))"]
        else:
            assert r["placements"] == ["(Shard(dim=0),)"]
        assert r["losses"] == r["plain_losses"]
        assert r["vs_plain"] == 0.0  # the same collectives on equal groups: the same bits
        assert max(abs(a - b) for a, b in zip(r["losses"], r["torch_losses"])) < 1e-5, r
        assert r["vs_torch"] < 1e-5, r
        if strategy != "NO_SHARD":
            assert r["into_torch"] == 0.0  # torch's state dict of it loads into fully_shard's model
        assert r["freed"], "the mesh keeps no sharded model alive"
        assert r["mesh_groups_alive"], "the user's groups are not destroyed with the model"
        assert max(r["diffs"]) < 1e-5, r["diffs"]


def test_a_mesh_shard_cannot_run_on_is_refused_saying_what_to_do():
    said = shardkit.spawn(refusals, 2, 2, threads_per_rank=1)[0]
    assert "mesh must be a torch.distributed.device_mesh.DeviceMesh, got str" in said["not_a_mesh"]
    assert "FULL_SHARD takes a 1-D mesh (ranks,), got a 2-D mesh of shape (2, 1)" in \
        said["two_dims_full_shard"]
    assert "HYBRID_SHARD takes a 2-D mesh (replica groups, ranks per group), got a 1-D" in \
        said["one_dim_hybrid"]
    assert "hybrid_group_size=2 disagrees with the mesh, whose shard dimension has 1 ranks" in \
        said["hybrid_size"]
    assert "the mesh holds 1 of the job's 2 ranks" in said["sub_mesh"]
    assert "parallelize_module(model, mesh['tp'], plan) first" in said["sub_mesh"]
    assert "the mesh lays the ranks out as [1, 0]; shard() needs them in rank order" in \
        said["out_of_order"]
    assert "mesh= and fault_tolerance= do not go together" in said["fault_tolerant"]
    assert "cannot run on a DeviceMesh: its collectives do not run on torch process groups" in \
        said["no_process_groups"]
    assert said["accepted"] is None  # one dimension of a mesh over every rank is taken
