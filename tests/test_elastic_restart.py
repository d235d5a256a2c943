"""`shardkit launch --max-restarts K` with examples/elastic_resume.py: kill a rank mid-training, the job
restarts, resumes from the newest complete checkpoint, and ends with the uninterrupted run's weights."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest
from safetensors.torch import load_file

from test_launch import ROOT, TIMEOUT, child_env, free_port, launch_cmd, run

EXAMPLE = os.path.join(ROOT, "examples", "elastic_resume.py")
STEPS, EVERY = 150, 10


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc), children first."""
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            with open(f"/proc/{parent}/task/{parent}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            continue
        out += kids
        todo += kids
    return out


def worker_with_rank(pid: int, rank: int) -> int | None:
    """The launched worker process whose environment says RANK=`rank`."""
    for child in descendants(pid):
        try:
            with open(f"/proc/{child}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if env.get(b"RANK") == str(rank).encode() and env.get(b"SHARDKIT_BACKEND"):
            return child
    return None


def run_interrupted(ckpt: str, export: str, extra: list[str], kill_after: int) -> tuple[str, int]:
    """Launch with restarts, SIGKILL rank 1 once rank 0 printed step `kill_after`.

    Returns the log and the last step rank 0 printed before the restart (the steps it had done).
    """
    proc = subprocess.Popen(launch_cmd() + [
        "--nproc", "2", "--max-restarts", "2", "--master-port", str(free_port()), EXAMPLE,
        "--ckpt-dir", ckpt, "--steps", str(STEPS), "--every", str(EVERY), "--export", export,
        *extra], env=child_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    lines, killed = [], False
    deadline = time.monotonic() + TIMEOUT
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        seen = re.match(r"step (\d+) loss", line)
        if seen and not killed and int(seen.group(1)) >= kill_after:
            victim = worker_with_rank(proc.pid, 1)
            assert victim is not None, "no worker with RANK=1 found under the launcher"
            os.kill(victim, signal.SIGKILL)
            killed = True
        if time.monotonic() > deadline:
            proc.kill()
            break
    proc.wait(timeout=60)
    log = "".join(lines)
    assert proc.returncode == 0, log
    assert killed, log
    steps = [int(m) for m in re.findall(r"^step (\d+) loss", log[:log.index("resumed from")], re.M)]
    return log, max(steps)


def fresh_run(tmp_path) -> dict:
    """The same job never interrupted: its final weights."""
    done = run(["--nproc", "2", "--master-port", str(free_port()), EXAMPLE, "--ckpt-dir",
                str(tmp_path / "plain"), "--steps", str(STEPS), "--every", str(EVERY),
                "--export", str(tmp_path / "plain-final")])
    assert done.returncode == 0, done.stdout + done.stderr
    return load_file(str(tmp_path / "plain-final" / "model.safetensors"))


@pytest.mark.slow
@pytest.mark.long  # two torchrun jobs of 150 steps each: 40-50 s
@pytest.mark.timeout(600)
# The synchronous save's case runs in the extended lane (the background one is the harder path).
@pytest.mark.parametrize("mode", [pytest.param("sync", marks=pytest.mark.extended), "background"])
def test_a_killed_rank_restarts_and_resumes_to_the_uninterrupted_weights(tmp_path, mode):
    extra = ["--background"] if mode == "background" else []
    log, last_step = run_interrupted(str(tmp_path / "ckpt"), str(tmp_path / "final"), extra,
                                     kill_after=25)
    resumed = [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", log)]
    assert len(resumed) == 1, log
    lost = last_step - resumed[0]
    # A sync save is complete when the step after it starts; a background one may still be
    # writing when the rank dies, so the one before it is the newest complete.
    assert 0 <= lost <= (EVERY if mode == "sync" else 2 * EVERY), (last_step, resumed, log)
    assert re.search(rf"^step {STEPS} loss", log, re.M), log
    interrupted = load_file(str(tmp_path / "final" / "model.safetensors"))
    reference = fresh_run(tmp_path)
    assert set(interrupted) == set(reference)
    for name, tensor in reference.items():  # bitwise: same data order, same reductions
        assert interrupted[name].equal(tensor), name


@pytest.mark.slow
@pytest.mark.extended  # about 27 s; CI's long lane resumes past a damaged checkpoint in test_checkpoint_latest.py
@pytest.mark.timeout(300)
def test_the_example_resumes_past_a_damaged_newest_checkpoint(tmp_path):
    # Before (issue 39): latest() read only manifests, returned the damaged checkpoint, and every
    # restart failed on it with CorruptCheckpointError.
    from _checkpoint_damage import flip_a_byte

    ckpt = tmp_path / "ckpt"
    first = run(["--nproc", "2", "--master-port", str(free_port()), EXAMPLE, "--ckpt-dir",
                 str(ckpt), "--steps", "30", "--every", "10"])
    assert first.returncode == 0, first.stdout + first.stderr
    rel = flip_a_byte(ckpt / "step_000030")
    again = run(["--nproc", "2", "--master-port", str(free_port()), EXAMPLE, "--ckpt-dir",
                 str(ckpt), "--steps", "40", "--every", "10"])
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resumed from {ckpt / 'step_000020'} at step 20" in again.stdout, again.stdout
    assert "skipping" in again.stderr and rel in again.stderr, again.stderr[-3000:]
