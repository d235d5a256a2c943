"""shardkit.checkpoint.latest / complete: only complete checkpoints count, newest step first."""

from __future__ import annotations

import json
import logging
import os

import pytest

import shardkit
import shardkit.checkpoint as ck
from shardkit.checkpoint import manifest as mf

from _agreement_workers import resume_verified, save_three
from _checkpoint_damage import flip_a_byte


def fake_checkpoint(path, step=None, created="2026-11-26T00:00:00+00:00", complete=True):
    """A directory shaped like a checkpoint (manifest written last, as save does)."""
    os.makedirs(path)
    with open(os.path.join(path, "shardkit_state.pt"), "wb") as f:
        f.write(b"x")
    if complete:
        with open(os.path.join(path, mf.MANIFEST_FILE), "w") as f:
            json.dump({"format": mf.FORMAT, "format_version": mf.FORMAT_VERSION, "step": step,
                       "created": created, "files": {}}, f)


def test_latest_is_the_highest_complete_step(tmp_path):
    assert ck.latest(tmp_path / "nothing-here") is None
    assert ck.latest(tmp_path) is None
    fake_checkpoint(tmp_path / "step_000010", step=10)
    fake_checkpoint(tmp_path / "step_000020", step=20)
    fake_checkpoint(tmp_path / "step_000030", step=30, complete=False)  # killed before its manifest
    os.makedirs(tmp_path / f"step_000040{mf.TMP_MARK}abc")  # a save still being written
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    fake_checkpoint(tmp_path / "best", step=15)  # named freely: the step orders it
    assert ck.latest(tmp_path) == str(tmp_path / "step_000020")
    assert ck.complete(tmp_path) == [str(tmp_path / n) for n in ("step_000010", "best",
                                                                  "step_000020")]


def test_a_replace_interrupted_between_its_renames_still_counts(tmp_path):
    # save() renames the old checkpoint to <path>.old, then the new one into place: a crash
    # between the two leaves only <path>.old, which load() reads as <path>.
    fake_checkpoint(tmp_path / ("step_000050" + mf.OLD_SUFFIX), step=50)
    fake_checkpoint(tmp_path / "step_000040", step=40)
    assert ck.latest(tmp_path) == str(tmp_path / "step_000050")
    assert mf.resolve(ck.latest(tmp_path)) == str(tmp_path / ("step_000050" + mf.OLD_SUFFIX))


def test_without_steps_the_newest_save_wins(tmp_path):
    fake_checkpoint(tmp_path / "b", created="2026-11-26T10:00:00+00:00")
    fake_checkpoint(tmp_path / "a", created="2026-11-26T11:00:00+00:00")
    assert ck.latest(tmp_path) == str(tmp_path / "a")


@pytest.mark.slow
@pytest.mark.long  # 12 s in the default lane on 2 cores (2026-11-29)
def test_verified_latest_resumes_past_a_damaged_newest_checkpoint(tmp_path, caplog):
    shardkit.spawn(save_three, 2, str(tmp_path), threads_per_rank=1)
    bad = flip_a_byte(tmp_path / "step_3")
    assert ck.latest(tmp_path) == str(tmp_path / "step_3")  # manifests only: not noticed
    with caplog.at_level(logging.WARNING, logger="shardkit"):
        assert ck.latest(tmp_path, verify=True) == str(tmp_path / "step_2")  # no job: local
    assert f"skipping {tmp_path / 'step_3'}" in caplog.text and bad in caplog.text
    # In a running job every rank hashes its share of the files and all agree.
    for r in shardkit.spawn(resume_verified, 2, str(tmp_path), threads_per_rank=1):
        assert r == {"chosen": "step_2", "step": 2}
    # Damaged everywhere (a truncated file in step_2 too, one in step_1): no checkpoint to resume.
    for name in ("step_2", "step_1"):
        manifest = mf.read_manifest(str(tmp_path / name))
        rel = sorted(manifest["files"])[0]
        os.truncate(tmp_path / name / rel, 1)
    assert ck.latest(tmp_path, verify=True) is None
    for r in shardkit.spawn(resume_verified, 2, str(tmp_path), threads_per_rank=1):
        assert r == {"chosen": None, "step": None}
