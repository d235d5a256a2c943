"""A save onto a file system that fills up says so in plain words (issue 26), on a real full disk.

The file system is a 4 MiB tmpfs mounted for the test (root only: skipped elsewhere, with the
reason). torch's zip writer reports the short write as "unexpected pos N vs M"; the error must
say "no space left on device", and the previous checkpoint must stay loadable.
"""

from __future__ import annotations

import os
import subprocess

import pytest

import shardkit

from _disk_full_workers import save_onto_a_full_disk


@pytest.fixture
def tiny_filesystem(tmp_path):
    mount = tmp_path / "tiny"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.slow
def test_a_full_disk_is_named_and_the_previous_checkpoint_survives(tiny_filesystem, tmp_path):
    filler = str(tiny_filesystem / "filler")
    out = shardkit.spawn(save_onto_a_full_disk, 2, str(tiny_filesystem), filler,
                         backend="cpu", threads_per_rank=1)
    for rank_out in out:
        error = rank_out["error"]
        assert error is not None and error.startswith("CheckpointError: saving "), error
        # Every rank's cause is named in words; torch's own words for a short write ("unexpected
        # pos 704 vs 598") may follow, never stand alone.
        causes = error.split(" (rank 0: ", 1)[1].split(". Any previous checkpoint")[0]
        for cause in causes.split("; rank "):
            assert "no space left on device" in cause.lower(), (cause, error)
        assert "is untouched: a save only replaces it once complete" in error
        assert rank_out["intact"]
        assert rank_out["left_over"] == []  # the temporary directory was removed
    assert not os.path.exists(filler)


@pytest.mark.slow
def test_a_full_disk_during_a_background_save_is_named_and_cleaned_up(tiny_filesystem):
    # Before (issue 39): "failed: ." (the report itself found no space) and, when another rank
    # reported first, rank 0 left the partial directory filling the disk.
    filler = str(tiny_filesystem / "filler")
    out = shardkit.spawn(save_onto_a_full_disk, 2, str(tiny_filesystem), filler, True,
                         backend="cpu", threads_per_rank=1)
    for rank_out in out:
        error = rank_out["error"]
        assert error is not None and "background save" in error, error
        assert "no space left on device" in error.lower(), error
        assert rank_out["left_over"] == []  # the temporary directory was removed
        assert rank_out["intact"]
