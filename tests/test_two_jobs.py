"""Two jobs on one machine never meet (issue 23), and a stopped rank is named with default settings.

Jobs are launched by hand the way mpirun-style scripts do (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT per process), on cpu/gloo. Every wait is bounded; the bounds asserted
are the failure contract (a rank of the wrong job fails within seconds of starting), not speed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardkit.launch_env import LaunchEnv, job_identity
from shardkit.job.rendezvous import JobRecord, conflict
from shardkit.job.spawn import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "_two_jobs_script.py"
# Importing torch and shardkit takes seconds on a busy 2-core machine; the check itself is
# immediate once the rank reaches the store.
FAIL_FAST_S = 25


class Rank:
    """One hand-launched rank: its process, when it started and what it printed."""

    def __init__(self, rank: int, world: int, port: int | None, tmp: Path, tag: str,
                 **extra: str) -> None:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("TORCHELASTIC", "SHARDKIT_", "MASTER_", "OMPI_", "SLURM_"))}
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   TEST_READY=str(tmp / f"{tag}.ready"), TEST_STOP=str(tmp / f"{tag}.stop"),
                   **extra)
        if port is not None:
            env["MASTER_PORT"] = str(port)
        self.rank = rank
        self.log = tmp / f"{tag}.{rank}.log"
        self.started = time.time()
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, str(SCRIPT)], env=env, stdout=out,
                                         stderr=subprocess.STDOUT, cwd=ROOT)
        self.ended: float | None = None

    def wait(self, timeout: float) -> int:
        """Wait for the rank to exit (killing it past `timeout`); return its exit status."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"rank {self.rank} still running after {timeout} s:\n"
                                 f"{self.text()}") from exc
        self.ended = self.ended or time.time()
        return code

    def text(self) -> str:
        """Everything the rank printed."""
        return self.log.read_text()

    def kill(self) -> None:
        """End the rank if it is still running (test cleanup)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _wait_for(path: Path, bound: float) -> None:
    deadline = time.time() + bound
    while not path.exists():
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.1)


@pytest.fixture
def ranks():
    started: list[Rank] = []
    yield started
    for rank in started:
        rank.kill()


def _start_job(ranks: list, tag: str, world: int, port: int | None, tmp: Path, **extra: str):
    job = [Rank(r, world, port, tmp, tag, **extra) for r in range(world)]
    ranks.extend(job)
    return job


@pytest.mark.slow
@pytest.mark.long
def test_a_second_job_on_a_taken_port_fails_fast_and_the_first_trains_on(tmp_path, ranks):
    port = free_port()
    job_a = _start_job(ranks, "a", 2, port, tmp_path)
    for r in range(2):
        _wait_for(tmp_path / f"a.ready.{r}", 120)
    job_b = _start_job(ranks, "b", 2, port, tmp_path)
    codes = [rank.wait(FAIL_FAST_S + 60) for rank in job_b]
    for rank, code in zip(job_b, codes):
        took = rank.ended - rank.started
        assert code != 0 and took < FAIL_FAST_S, (took, rank.text())
    a0_pid = job_a[0].proc.pid
    out0, out1 = job_b[0].text(), job_b[1].text()
    assert (f"rank 0 could not open the job's store: port 127.0.0.1:{port} is already in use by "
            f"another shardkit job, a job with no launcher id (world size 2, rank 0 is pid "
            f"{a0_pid} on ") in out0, out0
    assert (f"rank 1 connected to the store at 127.0.0.1:{port}, but rank 1 of that job already "
            f"joined it (pid {job_a[1].proc.pid} on ") in out1, out1
    for out in (out0, out1):
        assert "HINT: give each job its own port (MASTER_PORT=<free port>" in out
    # Job A never noticed: it trains on and finishes normally, both ranks on one model.
    (tmp_path / "a.stop").write_text("stop")
    assert [rank.wait(60) for rank in job_a] == [0, 0], [r.text() for r in job_a]
    lines = [rank.text().strip().splitlines()[-1] for rank in job_a]
    assert all(line.startswith(f"rank {r} trained ") for r, line in enumerate(lines)), lines


@pytest.mark.slow
@pytest.mark.long  # waits out its 4 s store timeout, then more
def test_a_rank_whose_store_never_opens_fails_within_the_timeout(tmp_path, ranks):
    port = free_port()  # nothing listens there: this job's rank 0 never started
    (lonely,) = [Rank(1, 2, port, tmp_path, "c", SHARDKIT_TIMEOUT="4")]
    ranks.append(lonely)
    assert lonely.wait(FAIL_FAST_S + 30) != 0
    out = lonely.text()
    assert lonely.ended - lonely.started < FAIL_FAST_S + 4, out
    assert (f"rank 1 could not reach the job's store at 127.0.0.1:{port} within timeout=4 s: "
            "rank 0 opens it, so rank 0 has not started or failed") in out, out


@pytest.mark.slow
@pytest.mark.long  # the default 30 s timeout has to run out
def test_a_stopped_rank_is_named_with_default_settings_through_finally_shutdown(tmp_path, ranks):
    # Rank 0 waits in a collective before rank 1 is stopped, so gloo's own 30 s timeout and the
    # watchdog's 30 s without heartbeats end within a second of each other: the report comes from
    # the exception path (the script's `finally: shardkit.shutdown()`) or from the watchdog
    # thread, whichever notices first, and either way the rank ends with status 75.
    mark = tmp_path / "sleeping"
    job = _start_job(ranks, "d", 2, free_port(), tmp_path, TEST_SLEEP_BEFORE_STEP="3",
                     TEST_MARK=str(mark))
    _wait_for(mark, 120)
    time.sleep(2.0)
    os.kill(job[1].proc.pid, signal.SIGSTOP)
    stopped = time.time()
    try:
        code = job[0].wait(90)
    finally:
        os.kill(job[1].proc.pid, signal.SIGCONT)
    out = job[0].text()
    assert code == 75, out
    # About 30 s (the default timeout) after the stop; before, shutdown() also waited 10 s for
    # the stopped peer as the store's host (40.8 s measured).
    assert 25 < job[0].ended - stopped < 37, (job[0].ended - stopped, out)
    last = out.strip().splitlines()[-1]
    assert "rank 1 stopped responding (no heartbeat" in last, out
    assert out.startswith("shardkit: rank 1 stopped responding"), out


def _env(**values) -> LaunchEnv:
    fields = dict(rank=1, world_size=2, local_rank=1, local_world_size=2,
                  master_addr="127.0.0.1", master_port=29500, launcher="torchrun", job_id=None)
    fields.update(values)
    return LaunchEnv(**fields)


def _record(**values) -> JobRecord:
    fields = dict(job_id=None, world_size=2, host="h", pid=7, launcher="torchrun")
    fields.update(values)
    return JobRecord(**fields)


@pytest.mark.parametrize("env,record,claimed,why", [
    (_env(), _record(), "me", None),
    (_env(job_id="SLURM_JOB_ID=5"), _record(job_id="SLURM_JOB_ID=5"), "me", None),
    # One side without an id cannot be compared by id; the rank claim still decides.
    (_env(job_id="SLURM_JOB_ID=5"), _record(), "me", None),
    (_env(job_id="SLURM_JOB_ID=5"), _record(job_id="SLURM_JOB_ID=6"), "me",
     "it belongs to job SLURM_JOB_ID=6, this rank is in job SLURM_JOB_ID=5"),
    (_env(world_size=3), _record(), "me",
     "it belongs to a job of world size 2, this one has 3"),
    (_env(), _record(), "pid 9 on h|node",
     "rank 1 of that job already joined it (pid 9 on h); this process (me) is another rank 1"),
])
def test_a_store_of_another_job_is_told_apart(env, record, claimed, why):
    assert conflict(env, record, claimed, "me") == why


def test_the_job_id_comes_from_the_launcher_that_names_one():
    assert job_identity({}) is None
    assert job_identity({"TORCHELASTIC_RUN_ID": "none"}) is None  # torchrun's unset default
    assert job_identity({"TORCHELASTIC_RUN_ID": "r1"}) == "TORCHELASTIC_RUN_ID=r1"
    assert job_identity({"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "3"}) == "SLURM_JOB_ID=42.3"
    assert job_identity({"OMPI_MCA_ess_base_jobid": "99", "SLURM_JOB_ID": "42"}) == \
        "OMPI_MCA_ess_base_jobid=99"
    assert job_identity({"PMIX_NAMESPACE": "prterun-x-1"}) == "PMIX_NAMESPACE=prterun-x-1"
    assert job_identity({"SHARDKIT_JOB_ID": "mine", "TORCHELASTIC_RUN_ID": "r1"}) == \
        "SHARDKIT_JOB_ID=mine"


def _side_by_side(commands: list[list[str]], tmp: Path) -> list[subprocess.CompletedProcess]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHELASTIC", "SHARDKIT_", "MASTER_", "RANK", "WORLD_SIZE",
                                "LOCAL_RANK"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TEST_READY=str(tmp / "ready"),
               TEST_STEPS="20")
    procs = [subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for cmd in commands]
    out = []
    for proc in procs:
        text, _ = proc.communicate(timeout=300)
        out.append(subprocess.CompletedProcess(proc.args, proc.returncode, text))
    return out


SPAWNED = """
import json, sys, time, torch, shardkit

def train(rank):
    with shardkit.seeded(0):
        model = shardkit.shard(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(15):
        model(torch.full((2, 4), float(rank + 1))).sum().backward()
        opt.step(); opt.zero_grad(); time.sleep(0.05)
    return [round(v, 6) for v in shardkit.full_tensor(model.weight).flatten().tolist()]

if __name__ == "__main__":
    print(json.dumps(shardkit.spawn(train, 2, backend="cpu", threads_per_rank=1)))
"""


@pytest.mark.slow
@pytest.mark.extended  # about 40 s; CI's long lane keeps the taken-port and stopped-rank cases of two jobs
def test_two_spawns_and_two_launches_run_side_by_side(tmp_path):
    script = tmp_path / "spawned.py"
    script.write_text(SPAWNED)
    runs = _side_by_side([[sys.executable, str(script)]] * 2
                         + [[sys.executable, "-m", "shardkit.cli.main", "launch", "--backend",
                             "cpu", "--nproc", "2", str(SCRIPT)]] * 2, tmp_path)
    assert [r.returncode for r in runs] == [0] * 4, [r.stdout[-2000:] for r in runs]
    weights = [json.loads(r.stdout.strip().splitlines()[-1]) for r in runs[:2]]
    # The reference: the same 15 steps in this process, on the mean of the ranks' inputs (the
    # loss is linear in the input, so the averaged gradient is that of the mean input).
    import torch

    torch.manual_seed(0)
    reference = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(15):
        reference(torch.full((2, 4), 1.5)).sum().backward()
        opt.step()
        opt.zero_grad()
    expected = reference.weight.detach().flatten().tolist()
    for per_rank in weights:
        for got in per_rank:
            assert got == pytest.approx(expected, abs=1e-5)
    for run in runs[2:]:
        assert "rank 0 trained 20 steps" in run.stdout and "rank 1 trained 20 steps" in run.stdout
