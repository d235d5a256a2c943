"""Ranks that call save()/load() with different arguments are refused before anything is written (issue 39).

Before: a sync save with per-rank paths was aborted by gloo ("Received data size doesn't match")
and left two temporary directories; a background one hung in wait() for 30 minutes.
"""

from __future__ import annotations

import pytest

import shardkit
from _agreement_workers import different_paths

pytestmark = pytest.mark.slow  # multi-process


@pytest.mark.timeout(120)
@pytest.mark.parametrize("background", [False, True])
def test_ranks_with_different_paths_are_refused_naming_each(tmp_path, background):
    results = shardkit.spawn(different_paths, 2, str(tmp_path), background, threads_per_rank=1)
    for r in results:
        save = r["save"]
        assert "shardkit.checkpoint.save was called with different arguments" in save, save
        assert "rank 0 '" in save and "run-1000'" in save and "run-1001'" in save
        assert "HINT" in save and "nothing was written" in save
        assert r["good"] == "same"
        assert "shardkit.checkpoint.load was called with different arguments" in r["load"]
        assert "same'" in r["load"] and "other'" in r["load"]
        assert "optimizer: rank 0 'torch.optim.adamw.AdamW', rank 1 None" in r["load_optimizer"]
        assert r["entries"] == ["same"]  # no run-* directory, no temporary one left
