"""One checkpoint format with FSDP2 (issue 54): shardkit.checkpoint.load reads the torch DCP
checkpoints FSDP2's users and torchtitan write, and FSDP2 reads shardkit.checkpoint.save's folder
with torch's own dcp.load; the weights and the next losses equal the writer's own resume, at the
world size that wrote them and at another."""

from __future__ import annotations

import pytest
import torch

import shardkit
from _dcp_interop_workers import (fsdp2_load_and_resume, fsdp2_save_and_resume, mismatch_run,
                                  shardkit_resume, shardkit_save_and_resume)

pytestmark = pytest.mark.slow  # multi-process


@pytest.mark.parametrize("layout", ["fsdp2", "torchtitan"])
@pytest.mark.long  # 18-21 s each in the default lane on 2 cores (2026-11-29)
def test_a_dcp_checkpoint_from_fsdp2_resumes_like_fsdp2(tmp_path, layout):
    folder = str(tmp_path / layout)
    theirs = shardkit.spawn(fsdp2_save_and_resume, 2, 2, folder, layout, threads_per_rank=1)[0]
    for world in (2, 3):
        ours = shardkit.spawn(shardkit_resume, world, world, folder, True, threads_per_rank=1)[0]
        assert ours["extra"] is None
        assert ours["steps_loaded"] and set(ours["steps_loaded"]) == {2.0}  # AdamW's counters
        assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-6, abs=1e-7), world
        assert ours["weights"].keys() == theirs["weights"].keys()
        for name, value in theirs["weights"].items():
            assert torch.allclose(ours["weights"][name], value, rtol=1e-5, atol=1e-6), (world, name)
    # The test can fail: without the optimizer's state the next losses differ.
    fresh = shardkit.spawn(shardkit_resume, 2, 2, folder, False, threads_per_rank=1)[0]
    assert fresh["losses"][1] != pytest.approx(theirs["losses"][1], rel=1e-6)
    if layout == "fsdp2":
        said = shardkit.spawn(mismatch_run, 2, 2, folder, threads_per_rank=1)[0]
        assert "does not hold this model's entries" in said and "HINT" in said, said
        assert "0.weight" in said  # names what is missing


@pytest.mark.long  # 21-26 s each: a save, three resumes at 2 and 3 ranks
# The background save's case (the same files, written by a thread) runs in the extended lane.
@pytest.mark.parametrize("background", [False, pytest.param(True, marks=pytest.mark.extended)],
                         ids=["save", "background-save"])
def test_fsdp2_resumes_from_a_shardkit_checkpoint_with_torchs_own_dcp_load(tmp_path, background):
    folder = str(tmp_path / "ckpt")
    ours = shardkit.spawn(shardkit_save_and_resume, 2, 2, folder, background,
                          threads_per_rank=1)[0]
    for world in (2, 3):
        theirs = shardkit.spawn(fsdp2_load_and_resume, world, world, folder, True,
                                threads_per_rank=1)[0]
        assert theirs["steps_loaded"] and set(theirs["steps_loaded"]) == {2.0}
        assert theirs["lr"] == [1e-2]
        assert theirs["losses"] == pytest.approx(ours["losses"], rel=1e-6, abs=1e-7), world
        assert theirs["weights"].keys() == ours["weights"].keys()
        for name, value in ours["weights"].items():
            assert torch.allclose(theirs["weights"][name], value, rtol=1e-5, atol=1e-6), (world, name)
    # The test can fail: FSDP2 with the weights alone (a fresh AdamW) takes other steps.
    fresh = shardkit.spawn(fsdp2_load_and_resume, 2, 2, folder, False, threads_per_rank=1)[0]
    assert fresh["losses"][0] == pytest.approx(ours["losses"][0], rel=1e-6)
    assert fresh["losses"][1] != pytest.approx(ours["losses"][1], rel=1e-6)
    # And shardkit still reads its own folder (the state file, not the pickled group entries).
    again = shardkit.spawn(shardkit_resume, 3, 3, folder, True, threads_per_rank=1)[0]
    assert again["extra"] == {"step": 2}
    assert again["losses"] == pytest.approx(ours["losses"], rel=1e-6, abs=1e-7)
