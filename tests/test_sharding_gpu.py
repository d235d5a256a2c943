"""The engine on an accelerator backend with streams (one rank): same numbers as unsharded."""

from __future__ import annotations

import pytest
import torch

import shardkit

from _sharding_workers import gpu_suite

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_every_strategy_and_feature_on_one_gpu():
    (r,) = shardkit.spawn(gpu_suite, 1, 1, backend="cuda", threads_per_rank=1)
    assert r["device"].startswith("cuda")
    runs = {**r["parity"], **{k: r[k] for k in ("no_sync", "meta", "tied", "called_twice",
                                                "prefetch2", "cpu_offload")}}
    worst = {name: (run["init_diff"], max(run["diffs"])) for name, run in runs.items()}
    assert all(init == 0.0 and diff <= 1e-5 for init, diff in worst.values()), worst
    assert r["cpu_offload"]["devices"] == ["cpu"]
    assert max(r["mixed_precision"]) <= 1e-5
