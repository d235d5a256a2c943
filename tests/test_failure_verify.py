"""Ranks that issue different collectives: named with verification on, never a hang with it off."""

from __future__ import annotations

import re

import pytest

import shardkit
from shardkit.sharding.step.verify import requested
from shardkit.job.spawn import SpawnError

from _verify_workers import diverge, two_verified_models

TIMEOUT_S = 8


def _reports(case: str, verify: bool | None) -> dict[int, str]:
    with pytest.raises(SpawnError) as info:
        shardkit.spawn(diverge, 2, 2, case, verify, threads_per_rank=1, timeout=TIMEOUT_S)
    return info.value.reports


@pytest.mark.slow
def test_verify_names_an_extra_no_grad_forward_at_its_first_collective():
    reports = _reports("extra_forward", True)
    for rank in (0, 1):
        assert re.search(
            r"CollectiveOrderError: ranks issued different collectives: collective #\d+ of group "
            r"\[0, 1\] is all_gather of \d+ x torch.float32 in unit '<root>', forward"
            + (r" \(no_grad\) on rank 0 but .* forward on rank 1" if rank == 0 else
               r" on rank 1 but .* forward \(no_grad\) on rank 0"), reports[rank]), reports[rank]


@pytest.mark.slow
def test_debug_env_verifies_and_names_a_unit_skipped_on_one_rank(monkeypatch):
    monkeypatch.setenv("SHARDKIT_DEBUG", "1")  # inherited by the ranks; shard(verify=None)
    reports = _reports("skipped_unit", None)
    for rank in (0, 1):
        match = re.search(r"collective #(\d+) of group \[0, 1\] is (all_gather of \d+ x "
                          r"torch.float32 in unit '[^']+', \w+) on rank (\d) but (.*) on rank (\d)",
                          reports[rank])
        assert match and match[3] == str(rank) and match[5] == str(1 - rank), reports[rank]
        assert match[2] != match[4]


@pytest.mark.slow
@pytest.mark.long  # the collective timeout has to run out
def test_without_verify_an_extra_forward_fails_within_the_timeout_saying_why():
    reports = _reports("extra_forward", False)
    for rank in (0, 1):
        text = reports[rank]
        if not text:
            # gloo ended this rank inside the mismatched collective ("Received data size doesn't
            # match expected size. Is there a distributed collective mismatch in your code?",
            # printed by gloo); its peer names it, with the hint.
            other = reports[1 - rank]
            assert re.search(rf"rank {rank} (is unreachable|died)", other), other
            assert "SHARDKIT_DEBUG=1" in other, other
            continue
        assert (f"a collective failed on rank {rank} in unit" in text
                or re.search(r"rank \d (raised|died|stopped|is unreachable)", text)), text
        if "a collective failed" in text:
            assert "HINT: the ranks probably issued different collectives (run with " \
                   "SHARDKIT_DEBUG=1" in text


@pytest.mark.slow
def test_without_verify_an_unused_parameter_on_one_rank_trains_correctly():
    results = shardkit.spawn(diverge, 2, 2, "unused_param", False, threads_per_rank=1,
                             timeout=TIMEOUT_S)
    for out in results:
        assert out["verified"] is None  # verification off: the engine uses the backend itself
        assert max(out["diffs"]) <= 1e-6, out["diffs"]  # vs one replica on every rank's batch


def test_debug_env_switches_verification_on_and_the_argument_wins(monkeypatch):
    monkeypatch.delenv("SHARDKIT_DEBUG", raising=False)
    assert not requested(None) and requested(True)
    for value, on in (("1", True), ("yes", True), ("0", False), ("", False), ("off", False)):
        monkeypatch.setenv("SHARDKIT_DEBUG", value)
        assert requested(None) is on and requested(False) is False and requested(True) is True


def test_two_verified_models_in_one_job_keep_their_own_sequences():
    """Each verified model numbers its collectives in its own keys: a student's first collective
    is never compared with the teacher's first (a false CollectiveOrderError before)."""
    for r in shardkit.spawn(two_verified_models, 2, 2, threads_per_rank=1):
        assert all(n > 10 for n in r["verified"]), r["verified"]
        assert max(r["diffs"]) <= 1e-5, r["diffs"]
