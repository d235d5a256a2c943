"""Ranks that call save()/load() with different arguments are refused before anything is written (issue 39).

Before: a sync save with per-rank paths was aborted by gloo ("Received data size doesn't match")
and left two temporary directories; a background one hung in wait() for 30 minutes.
"""

from __future__ import annotations

import pytest

import shardkit
from _agreement_workers import bad_write_timeout, different_paths

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


@pytest.mark.parametrize("value", ["abc", "-5", "0", "nan"])
def test_a_bad_checkpoint_timeout_is_refused_with_the_range(monkeypatch, value):
    from shardkit.checkpoint import background

    monkeypatch.setenv("SHARDKIT_CHECKPOINT_TIMEOUT", value)
    with pytest.raises(shardkit.ShardkitError, match="from 1 to 2592000") as info:
        background.write_timeout_s()
    assert repr(value) in str(info.value) and "HINT" in str(info.value)
    monkeypatch.setenv("SHARDKIT_CHECKPOINT_TIMEOUT", "90")
    assert background.write_timeout_s() == 90.0


def test_only_background_saves_read_the_checkpoint_timeout(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDKIT_CHECKPOINT_TIMEOUT", "abc")
    (r,) = shardkit.spawn(bad_write_timeout, 1, str(tmp_path), threads_per_rank=1)
    assert r["sync"] == "sync"
    assert "SHARDKIT_CHECKPOINT_TIMEOUT must be a number of seconds" in r["background"]
    assert r["entries"] == ["sync"]  # nothing written for the refused one
