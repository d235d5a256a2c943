"""Several ranks on one GPU: CUDA's device side with gloo's collectives ("cuda+gloo"), the engine's
multi-rank CUDA path (streams overlapping real collectives, events, record_stream, pooled
buffers) against the one-process run, the conformance suite at 2 and 4 ranks, and torch's CUDA
sanitizer over it. Run with `pytest -m gpu tests/test_one_gpu_ranks.py`; skipped without a GPU.

SHARDKIT_TEST_ONE_DEVICE_PAIR=cpu+gloo runs the same tests (but the sanitizer's) on the host.
"""

from __future__ import annotations

import os

import pytest
import torch

import shardkit
from shardkit.testing import run_world

from _one_device_workers import UNSYNCED_CONFIGS, compiled_blocks_run, one_device_suite, unsynced_steps

PAIR = os.environ.get("SHARDKIT_TEST_ONE_DEVICE_PAIR", "cuda+gloo")
ON_GPU = PAIR.startswith("cuda")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(ON_GPU and not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _spawn(fn, world: int, *args, **kwargs):
    return shardkit.spawn(fn, world, *args, backend=PAIR, threads_per_rank=1, **kwargs)


def _sanitized(fn, world: int, *args):
    # A fresh interpreter per rank: TORCH_CUDA_SANITIZER is read by `import torch`, and the
    # forkserver's ranks would inherit a torch imported without it. A rank stopped by a race
    # leaves its peers in a collective: they stop after 60 s, not the accelerator's 10 minutes.
    return _spawn(fn, world, *args, start_method="spawn", timeout=60)


@pytest.mark.parametrize("world", [2, 4])
def test_conformance_of_cuda_with_gloo(world):
    result = run_world(PAIR, world)
    assert result.skipped is None and result.failed_checks() == [], result.failures


@pytest.mark.parametrize("world", [2, 4])
def test_every_strategy_and_feature_on_ranks_sharing_one_gpu(world):
    results = _spawn(one_device_suite, world, world)
    for r in results:
        assert r["backend"] == PAIR and r["device"].startswith(PAIR.split("+")[0])
        worst = {name: (run["init_diff"], max(run["diffs"])) for name, run in r["runs"].items()}
        if r is results[0]:
            print(f"\n{PAIR} x{world}: worst (init, step) difference per run: {worst}; "
                  f"bf16 {max(r['bf16'])}")
        assert all(init == 0.0 and diff <= 1e-5 for init, diff in worst.values()), worst
        assert r["runs"]["cpu_offload"]["devices"] == ["cpu"]
        assert max(r["bf16"]) <= 1e-5


def test_quantized_collectives_on_ranks_sharing_one_gpu():
    # The int8 encode / decode on the device, on its gather and reduce streams (shardkit.Quantization).
    from _quantize_workers import training

    runs = [("FULL_SHARD", q, {}) for q in ("exact", "weights", "gradients", "both")]
    runs += [("HYBRID_SHARD", "both", {"hybrid_group_size": 2}),
             ("FULL_SHARD", "both", {"prefetch": 2})]
    results = _spawn(training, 4, 4, runs)
    for key, run in results[0].items():
        assert all(r[key]["digest"] == run["digest"] for r in results), key
        bound = 1e-5 if "/exact/" in key else 2e-3  # as on the host (tests/test_quantize.py)
        assert max(run["diffs"]) < bound, (key, run["diffs"])


def test_compiled_blocks_on_ranks_sharing_one_gpu():
    results = _spawn(compiled_blocks_run, 2, 2)
    worst = [(r["init_diff"], max(r["diffs"])) for r in results]
    print(f"\n{PAIR} x2, block.compile(): {worst}")
    assert all(init == 0.0 and diff <= 1e-5 for init, diff in worst), worst


needs_sanitizer = pytest.mark.skipif(not ON_GPU, reason="torch's CUDA sanitizer needs CUDA")


@needs_sanitizer
def test_sanitized_steps_without_host_syncs_find_no_race(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_SANITIZER", "1")  # read by each rank's `import torch`
    results = _sanitized(unsynced_steps, 2, 2, list(UNSYNCED_CONFIGS))
    print(f"\nsanitized steps, rank 0: {results[0]}")
    for r in results:
        assert all(run["error"] is None for run in r.values()), r
        assert all(run["diff"] <= 1e-5 for name, run in r.items() if name != "bf16"), r


@needs_sanitizer
def test_sanitized_strategies_and_features_find_no_race(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_SANITIZER", "1")
    (r, _) = _sanitized(one_device_suite, 2, 2)  # a race raises in the rank, failing the spawn
    worst = {name: max(run["diffs"]) for name, run in r["runs"].items()}
    assert max(worst.values()) <= 1e-5 and max(r["bf16"]) <= 1e-5, worst


@needs_sanitizer
def test_the_cuda_sanitizer_catches_a_missing_wait(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_SANITIZER", "1")
    results = _sanitized(unsynced_steps, 2, 2, ["FULL_SHARD"], 3, True)
    errors = [r["FULL_SHARD"]["error"] for r in results]
    print(f"\nsanitized run with the reduce stream's wait skipped: {errors}")
    assert all(e and "CUDASanitizerErrors" in e and "data race" in e for e in errors), errors
