"""A background save in flight when a rank dies never hangs a survivor (issue 39).

Two ranks, started mpirun-style (RANK/WORLD_SIZE in the environment) or by `shardkit launch`:
a synchronous save at step 1, a background save at step 3, and the victim SIGKILLs itself right
after it (its writer thread mid-write). Before: the survivor printed its report and then waited
at exit for the dead peer's shard file for the write timeout (1800 s), with the loop inside
`try/finally: shutdown()` or not. Now it ends within seconds with one report, the abandoned
save is removed or marked failed beside its temporary directory, and step 1 stays the checkpoint.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import shardkit.checkpoint as ck
from shardkit.job.spawn import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "tests" / "_bg_fault_script.py")
# init(timeout=10) in the script; the survivor ends well inside it (about 3 s here).
ENDS_WITHIN_S = 20

pytestmark = pytest.mark.slow


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHELASTIC", "SHARDKIT_", "MASTER_", "RANK", "WORLD_SIZE",
                                "LOCAL_RANK", "LOCAL_WORLD_SIZE"))}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def _check_checkpoint(root: Path) -> None:
    assert ck.inspect_checkpoint(str(root / "ckpt"))["step"] == 1
    assert ck.latest(root, verify=True) == str(root / "ckpt")
    for name in os.listdir(root):
        if ".tmp-" in name and not name.endswith(".failed"):
            assert (root / (name + ".failed")).exists(), name  # marked: never a checkpoint


@pytest.mark.parametrize("victim", [0, 1])
@pytest.mark.parametrize("style", ["plain", "finally"])
@pytest.mark.long  # 7-12 s each, 36 s in all in the default lane on 2 cores (2026-11-29)
def test_raw_ranks_end_in_seconds_when_a_peer_dies_during_a_background_save(tmp_path, victim, style):
    port = str(free_port())
    procs, logs = [], []
    for rank in range(2):
        log = open(tmp_path / f"out{rank}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, SCRIPT, str(tmp_path), str(victim), style], cwd=ROOT, stdout=log,
            stderr=subprocess.STDOUT,
            env=_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank),
                      "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"})))
    survivor = 1 - victim
    try:
        assert procs[victim].wait(timeout=120) == -9
        status = procs[survivor].wait(timeout=120)
        ended = time.time()
    finally:
        for p in procs:
            p.kill()
        for log in logs:
            log.close()
    started = float((tmp_path / f"survivor{survivor}").read_text())
    assert ended - started < ENDS_WITHIN_S, ended - started
    assert status == 75  # PEER_FAILED_EXIT: not the cause
    out = (tmp_path / f"out{survivor}.log").read_text()
    reports = [line for line in out.splitlines() if line.startswith("shardkit:")]
    assert len(reports) == 1 and f"rank {victim} died" in reports[0], out[-3000:]
    # No C++ warning per store call once the store's host is gone (0 here in 12 runs; one
    # torch warning from a call already in flight would not be a loop).
    assert out.count("TCPStore.cpp") <= 1, out[-3000:]
    _check_checkpoint(tmp_path)


@pytest.mark.long
@pytest.mark.parametrize("victim", [0, 1])
def test_launched_ranks_end_in_seconds_when_a_peer_dies_during_a_background_save(tmp_path, victim):
    started = time.time()
    done = subprocess.run([sys.executable, "-m", "shardkit.cli.main", "launch", "--backend", "cpu",
                           "--nproc", "2", SCRIPT, str(tmp_path), str(victim), "finally"],
                          cwd=ROOT, env=_env({}), capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert time.time() - started < ENDS_WITHIN_S + 30  # the launcher's own start and teardown
    assert "SIGKILL" in done.stderr + done.stdout
    _check_checkpoint(tmp_path)
