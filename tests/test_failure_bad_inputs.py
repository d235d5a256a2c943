"""Bad inputs get errors that say what was wrong and what to do (texts asserted).

Cases already covered elsewhere are not repeated: shard() twice, a HYBRID group size that does
not divide the world, a strategy typo, device "meta:0" and prefetch (test_sharding_api.py);
unknown and unavailable backends by environment and CLI (test_plugins.py, test_launch.py);
damaged, truncated and manifest-less checkpoints, deeper and wider models (test_checkpoint_*.py).
"""

from __future__ import annotations

import pytest

import shardkit
from shardkit import Backend
from shardkit.install_hint import pip_install_extra
from shardkit_backends.cpu import CPUBackend

from _failure_workers import bad_inputs


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("bad_inputs"))
    return shardkit.spawn(bad_inputs, 2, 2, root, threads_per_rank=1, timeout=60)


def test_shard_misuse_is_refused_with_what_to_do(results):
    for out in (r["misuse"] for r in results):
        assert out["unknown_backend"].startswith("BackendNotFoundError: unknown backend 'nope'. "
                                                 "Registered backends:")
        assert "- cpu: available" in out["unknown_backend"]
        assert out["backend_not_installed"].startswith(
            "BackendUnavailableError: backend 'xpu' is not available")
        assert f"HINT: {pip_install_extra('xpu')}" in out["backend_not_installed"]
        assert out["device_float"] == ("ShardkitError: device_id must be None, an int, a string "
                                       "or a torch.device, got float")
        assert "device_id 'xpu:0' is a 'xpu' device but the 'cpu' backend runs on 'cpu'" in \
            out["device_other_type"]
        # One host device: the CPU backend maps any index to it (launchers pass LOCAL_RANK).
        assert out["device_out_of_range"] is None and out["device_int_out_of_range"] is None
        for key, shown in (("strategy_typo", "'full_shrd'; did you mean 'FULL_SHARD'?"),
                           ("strategy_type", "3;")):
            assert out[key] == (f"ShardkitError: unknown sharding strategy {shown} choose one of "
                                "FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD")
        assert out["string_strategy"] == "SHARD_GRAD_OP"
        assert "shard() got a model with no parameters (Sequential)" in out["zero_params"]
        assert ("module <root> (_RawModule) has meta-device tensors but no reset_parameters(); "
                "HINT: pass param_init_fn=fn") in out["meta_no_reset"]
        # (torch's own words were "aten.copy_.default got mixed torch.Tensor and DTensor")
        assert out["tensor_parallel_model"].startswith(
            "ShardkitError: parameter '0.weight' is already a DTensor (placements (Shard(dim=0),)")
        assert "HINT: for tensor parallel x data parallel pass mesh=mesh['dp']" in \
            out["tensor_parallel_model"]
        assert "after fully_shard, pass shard() the plain model" in out["tensor_parallel_model"]


def test_optimizer_built_before_shard_fails_on_its_first_step(results):
    for out in (r["misuse"] for r in results):
        text = out["optimizer_before_shard"]
        assert text.startswith("ShardkitError: SGD was built before shardkit.shard(): it holds 30 "
                               "parameter(s) the model no longer uses ('conv.weight', "
                               "'conv.bias', 'embed.weight', ...)"), text
        assert "HINT: create the optimizer after shard()" in text
        assert out["optimizer_before_shard_again"] == text  # every step, not only the first
        assert out["optimizer_after_shard"] is None and out["late_trained"]


def test_device_index_out_of_range_on_a_backend_with_indices():
    class TwoDevices(CPUBackend):
        name = "two-devices"
        indexed_device = Backend.indexed_device

        def device_count(self) -> int:
            return 2

    be = TwoDevices()
    assert str(be.normalize_device("cpu:1", 0)) == "cpu:1"
    for bad in (5, "cpu:2"):
        with pytest.raises(shardkit.ShardkitError, match=r"device index \d is out of range: this "
                                                         r"process sees 2 cpu device\(s\)"):
            be.normalize_device(bad, 0)
    with pytest.raises(shardkit.ShardkitError, match="device_id -1 is negative"):
        be.normalize_device(-1, 0)
    with pytest.raises(shardkit.ShardkitError, match="got bool"):
        be.normalize_device(True, 0)


def test_checkpoint_failures_say_where_and_keep_the_previous_checkpoint(results):
    for out in (r["checkpoint"] for r in results):
        assert out["read_only"].startswith("CheckpointError: creating ")
        assert "/ro/ckpt.tmp-" in out["read_only"]
        assert out["read_only"].endswith("failed on rank 0: OSError: [Errno 30] Read-only file system")
        full = out["disk_full"]
        assert full.startswith("CheckpointError: saving ") and "/ckpt failed while writing shard " \
            "files into " in full and "(rank 1: OSError: [Errno 28] No space left on device)" in full
        assert "is untouched: a save only replaces it once complete" in full
        assert out["previous_intact"]  # loads, verifies its hashes, and holds the step-1 state
        assert out["not_weights_only"].startswith(
            "CheckpointError: extra cannot be stored: loading it back would need to unpickle code")
        assert not out["x_exists"]
        assert out["unpicklable"].startswith("CheckpointError: extra cannot be stored: it does not "
                                             "pickle") and "HINT" in out["unpicklable"]
        assert out["saved_after_unpicklable"]
        assert out["missing_dir"] == (
            f"CheckpointNotFoundError: no checkpoint at {out['missing_dir'].split(' at ')[1]}")
        assert "/never-saved. HINT: complete checkpoints nearby: " in out["missing_dir"], out
        assert "unexpected in the source (11): blocks.1.fc1.bias, blocks.1.fc1.weight" in out["shallower"]
        assert "missing in the source (11): blocks.2.fc1.bias, blocks.2.fc1.weight" in out["deeper"]
        assert "shape mismatch (27): blocks.0.fc1.bias: source [29] vs model [33]" in out["wider"]
        assert out["non_strict_loaded"] and out["non_strict_kept"]
        assert "shape mismatch (27): blocks.0.fc1.bias: source [29] vs model [33]" in \
            out["non_strict_wider"]
        assert "pass strict=False (shardkit.checkpoint.load or load_full_state_dict)" in out["deeper"]
        assert out["other_optimizer"] == (
            f"CheckpointError: checkpoint {out['other_optimizer'].split()[2]} holds the state of a "
            "torch.optim.adamw.AdamW optimizer, but the optimizer given to load() is a "
            "torch.optim.sgd.SGD. HINT: build the same optimizer class as at save time, or load "
            "the model alone (shardkit.checkpoint.load(path, model)) and start a fresh optimizer.")
        for key in ("shallower", "deeper", "wider"):
            assert out[key].startswith("StateDictMismatchError: checkpoint ")
