"""What a user sees when a rank fails (issue 26): shardkit's one line first and last, on every
launch path, with and without `try: ... finally: shardkit.shutdown()`, and no rank left waiting.

Each case runs a 2-rank cpu/gloo job in which rank 1 fails on purpose (tests/_report_script.py):
it raises (its own error), or it skips a backward so the ranks issue different collectives. The
bounds are the failure contract (timeout plus start-up slack), not speed figures.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardkit.failure import PEER_FAILED_EXIT
from shardkit.job.spawn import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "_report_script.py"
TIMEOUT_S = 5  # short: the out-of-step cases end by the collectives' timeout
RAISED = "shardkit: rank 1 raised ValueError: bad batch on rank 1 (in "
OUT_OF_STEP = ("a collective failed on rank {rank} in unit '{unit}', backward, and no other rank "
               "failed: ")
DEBUG_HINT = "HINT: the ranks probably issued different collectives (run with SHARDKIT_DEBUG=1"


def _env(tmp: Path, failure: str, with_finally: bool, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHELASTIC", "SHARDKIT_", "MASTER_", "RANK", "WORLD_SIZE",
                                "LOCAL_RANK"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TEST_FAILURE=failure,
               TEST_FINALLY="1" if with_finally else "0", TEST_TIMEOUT=str(TIMEOUT_S),
               TEST_MARK=str(tmp / "failed_at"), **extra)
    return env


def _lines(text: str) -> list[str]:
    return [line for line in text.strip().splitlines() if line.strip()]


def _run_by_hand(tmp: Path, failure: str, with_finally: bool) -> tuple[list, list, list[float]]:
    """Two ranks started the way mpirun-style scripts do; their exit codes, outputs, exit times."""
    port = str(free_port())
    procs, logs = [], []
    for rank in range(2):
        env = _env(tmp, failure, with_finally, RANK=str(rank), WORLD_SIZE="2",
                   LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        log = open(tmp / f"rank{rank}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT)], env=env, cwd=ROOT,
                                      stdout=log, stderr=subprocess.STDOUT))
    ended: dict[int, float] = {}
    deadline = time.time() + 120 + 2 * TIMEOUT_S
    while len(ended) < 2 and time.time() < deadline:
        for rank, proc in enumerate(procs):
            if rank not in ended and proc.poll() is not None:
                ended[rank] = time.time()
        time.sleep(0.05)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for log in logs:
        log.close()
    assert len(ended) == 2, "a rank was still running long after the failure"
    return ([p.returncode for p in procs], [(tmp / f"rank{r}.log").read_text() for r in range(2)],
            [ended[r] for r in range(2)])


def _failed_at(tmp: Path) -> float:
    return float((tmp / "failed_at").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("with_finally", [pytest.param(True, marks=pytest.mark.long), False],
                         ids=["finally-shutdown", "plain"])
def test_by_hand_a_raising_rank_is_named_by_its_peer_at_once(tmp_path, with_finally):
    codes, outs, ended = _run_by_hand(tmp_path, "raise", with_finally)
    failed_at = _failed_at(tmp_path)
    survivor, victim = _lines(outs[0]), _lines(outs[1])
    assert codes == [PEER_FAILED_EXIT, 1], outs
    # The survivor says one thing, first and last: who failed, with what, and where it was.
    assert survivor[0].startswith(RAISED) and survivor[-1].startswith(RAISED), outs[0]
    assert len(survivor) == 1, outs[0]
    # The failed rank's own traceback is its report, ending with its error.
    assert victim[0].endswith("Traceback (most recent call last):"), outs[1]
    assert victim[-1].endswith("ValueError: bad batch on rank 1"), outs[1]
    assert not any("Exception raised from" in line or "frame #" in line for line in victim), outs[1]
    for rank in range(2):  # neither waits for the timeout (nor the store host for its peers)
        assert ended[rank] - failed_at < 6, (rank, ended[rank] - failed_at, outs[rank])


@pytest.mark.slow
@pytest.mark.long  # the collective timeout has to run out
@pytest.mark.parametrize("with_finally", [True, False], ids=["finally-shutdown", "plain"])
def test_by_hand_ranks_out_of_step_get_the_debug_hint_not_a_dead_rank(tmp_path, with_finally):
    codes, outs, ended = _run_by_hand(tmp_path, "out_of_step", with_finally)
    failed_at = _failed_at(tmp_path)
    assert codes == [1, 1], outs
    for rank in (0, 1):
        lines = _lines(outs[rank])
        # Which unit's collective times out first depends on the schedule (the root keeps its
        # parameters for backward, so backward issues no root gather); any unit, named.
        unit = re.match(r"shardkit: a collective failed on rank \d in unit '([^']+)'", lines[0])
        assert unit, outs[rank]
        expected = "shardkit: " + OUT_OF_STEP.format(rank=rank, unit=unit.group(1))
        assert lines[0].startswith(expected) and DEBUG_HINT in lines[0], outs[rank]
        # The collective's own traceback (mostly C++ frames) is kept in the file the line names.
        assert "the failed collective's traceback: " in lines[0]
        path = lines[0].split("the failed collective's traceback: ")[1].split(";")[0]
        assert "Traceback (most recent call last)" in Path(path).read_text()
        assert expected in lines[-1], outs[rank]
        assert "died" not in outs[rank]
        assert len(lines) <= (12 if with_finally else 1), outs[rank]
        # Ended by the 5 s collective timeout, not a hang to the default one (minutes). The slack
        # is sized from the worst measured under load: 23.8 s after the failure with 8 ranks of
        # another test beside it, 22.3 s beside 10 busy loops (load 9-12 on 2 cores), where
        # 8 s of slack failed; 2-3 s on a quiet machine.
        assert ended[rank] - failed_at < TIMEOUT_S + 30, (rank, ended[rank] - failed_at)


@pytest.mark.slow
@pytest.mark.parametrize("failure", ["raise", pytest.param("out_of_step", marks=pytest.mark.long)])
def test_spawn_with_finally_shutdown_still_names_the_cause(tmp_path, failure):
    result = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, capture_output=True,
                            text=True, timeout=180,
                            env=_env(tmp_path, failure, True, TEST_VIA="spawn"))
    assert result.returncode != 0
    out = result.stderr
    if failure == "raise":
        assert "rank 0: process 0 exited with status 75" in out and RAISED in out, out[-3000:]
    else:
        assert re.search(r"shardkit: " + re.escape(OUT_OF_STEP.format(rank=1, unit="UNIT"))
                         .replace("UNIT", "[^']+"), out), out[-3000:]
        assert DEBUG_HINT in out and "died" not in out, out[-3000:]


@pytest.mark.slow
@pytest.mark.long  # 13 s: a launched job
def test_shardkit_launch_with_finally_shutdown_names_the_raising_rank(tmp_path):
    started = time.time()
    result = subprocess.run([sys.executable, "-m", "shardkit.cli.main", "launch", "--backend",
                             "cpu", "--nproc", "2", str(SCRIPT)], cwd=ROOT, capture_output=True,
                            text=True, timeout=180, env=_env(tmp_path, "raise", True))
    ended = time.time()
    assert result.returncode != 0
    out = result.stdout + result.stderr
    # The survivor's one line, not gloo's "Connection reset by peer", and no late exit of the
    # store's host (torchrun's agent hosts it here).
    assert RAISED in out and "Connection reset by peer" not in out, out[-4000:]
    assert "ValueError: bad batch on rank 1" in out
    # One story: the launcher's summary names the rank that raised first (not the survivor's
    # status 75), in a few lines instead of torchrun's own traceback, and the failed rank is not
    # SIGTERMed into a second report.
    summary = out.split("shardkit launch: _report_script.py failed\n", 1)[1].splitlines()
    assert re.match(r"  rank 1 \(local 1, pid \d+\) exited with status 1 \(the root cause\): "
                    r"ValueError: bad batch on rank 1", summary[0]), out[-3000:]
    assert re.match(r"  rank 0 \(local 0, pid \d+\) (exited with status 75|was stopped by torchrun)",
                    summary[1]), out[-3000:]
    assert "torch/distributed/run.py" not in out and "ChildFailedError" not in out, out[-3000:]
    assert "was terminated (SIGTERM" not in out, out[-3000:]
    assert ended - _failed_at(tmp_path) < 10, (ended - _failed_at(tmp_path), ended - started)
