"""SLURM for real (issue 56): slurmctld and a slurmd per simulated node (tests/simslurm.py), and
jobs submitted as users submit them: the docs' sbatch script (one `shardkit launch` per node) and
srun starting every rank directly. Both train bit for bit as the same 4 ranks under torchrun.

What the real srun showed that hand-set variables did not: without --ntasks-per-node it sets no
SLURM_NTASKS_PER_NODE (the per-node counts are in SLURM_TASKS_PER_NODE, "3,1" for `srun -N2 -n4`
on 4-CPU nodes), it exports no MASTER_ADDR, and the node list comes compressed ("n[0-1]").
Needs root, iproute2 and Debian's slurm-wlm and munge (.ci/run installs them); skips otherwise.
"""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
import torch

from simslurm import SimSlurm, unavailable_reason
from test_launch import ROOT, TIMEOUT, child_env, launch_cmd

SCRIPT = os.path.join(ROOT, "tests", "_multinode_script.py")
PAGE = os.path.join(ROOT, "docs", "guide", "multi-node.md")
DOC_LAUNCH = 'srun shardkit launch --nnodes "$SLURM_NNODES"'  # finds the page's sbatch script
STEPS = 4

pytestmark = [pytest.mark.long, pytest.mark.timeout(600),
              pytest.mark.skipif(unavailable_reason() is not None,
                                 reason=f"SLURM on simulated nodes: {unavailable_reason()}")]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    # Three nodes, so a job of two that loses one is requeued onto the other two; a node that
    # stops answering is DOWN after 10 s and a requeued job may start 10 s later (SLURM's
    # defaults, 300 s and 120 s, would only make the failure test wait).
    with SimSlurm(3, str(tmp_path_factory.mktemp("slurm")), slurmd_timeout=10,
                  requeue_delay=10) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def torchrun_reference(tmp_path_factory):
    """The same script as 4 ranks of one torchrun job on this machine."""
    import subprocess

    out = str(tmp_path_factory.mktemp("torchrun") / "torchrun.json")
    done = subprocess.run(launch_cmd() + ["--nproc", "4", SCRIPT, out, "FULL_SHARD", str(STEPS)],
                          env=child_env(), cwd=ROOT, capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return _report(out)


def _report(out: str) -> tuple[dict, dict]:
    with open(out) as f:
        report = json.load(f)
    return report, torch.load(out + ".pt")


def _same_training(ours: tuple[dict, dict], theirs: tuple[dict, dict]) -> None:
    assert ours[0]["losses"] == theirs[0]["losses"]
    _same_weights(ours[1], theirs[1])


def _same_weights(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys()
    for name, value in ours.items():
        assert torch.equal(value, theirs[name]), name


def _user_env() -> dict[str, str]:
    """A user's shell with this environment activated: its `shardkit` first on PATH."""
    env = child_env()
    env.update(OMP_NUM_THREADS="1",
               PATH=os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")]))
    return env


@pytest.mark.extended  # about 35 s; CI's long lane runs the docs' sbatch script
def test_srun_starting_every_rank_trains_as_torchrun(slurm, torchrun_reference, tmp_path):
    out = str(tmp_path / "srun.json")
    # No --ntasks-per-node and no MASTER_ADDR: srun's own layout (3 tasks on the first node,
    # 1 on the second) and its compressed node list are all shardkit has.
    done = slurm.run(["srun", "-N2", "-n4", sys.executable, SCRIPT, out, "FULL_SHARD", str(STEPS)],
                     timeout=TIMEOUT, **_user_env())
    assert done.returncode == 0, done.stdout[-4000:]
    ours = _report(out)
    ranks = ours[0]["ranks"]
    assert {r["launcher"] for r in ranks} == {"slurm"}
    assert [r["local_world_size"] for r in ranks] == [3, 3, 3, 1]
    _same_training(ours, torchrun_reference)


def _doc_sbatch_script(requeue: bool = False) -> str:
    with open(PAGE) as f:
        page = f.read()
    blocks = re.findall(r"```bash\n(.*?)```", page, re.S)
    (script,) = [b for b in blocks if DOC_LAUNCH in b and ("--requeue" in b) == requeue]
    return script


def _sized(script: str, *replacements: tuple[str, str]) -> str:
    """The page's script for these nodes (2 CPUs and 2 ranks each), the test's command for train.py."""
    for page_text, here in (("--cpus-per-task=32", "--cpus-per-task=2"), ("--nproc 8", "--nproc 2"),
                            *replacements):
        assert page_text in script, page_text
        script = script.replace(page_text, here)
    return script


def test_the_docs_sbatch_script_trains_as_torchrun(slurm, torchrun_reference, tmp_path):
    out = str(tmp_path / "sbatch.json")
    script = _sized(_doc_sbatch_script(), ("train.py", f"{SCRIPT} {out} FULL_SHARD {STEPS}"))
    path = tmp_path / "train.sbatch"
    path.write_text(script)
    done = slurm.run(["sbatch", "--wait", f"--output={tmp_path}/slurm-%j.out", str(path)],
                     timeout=TIMEOUT, **_user_env())
    logs = "".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert done.returncode == 0, done.stdout[-2000:] + logs[-4000:]
    ours = _report(out)
    ranks = ours[0]["ranks"]
    assert {r["launcher"] for r in ranks} == {"torchrun"}
    assert [r["local_world_size"] for r in ranks] == [2, 2, 2, 2]
    _same_training(ours, torchrun_reference)


RESUME_EXAMPLE = os.path.join(ROOT, "examples", "elastic_resume.py")
RESUME_STEPS, RESUME_EVERY, KILL_AFTER = 120, 10, 30


def _job(slurm: SimSlurm, job_id: str) -> dict[str, str]:
    """scontrol's record of a job: {field: value}."""
    done = slurm.run(["scontrol", "show", "job", "-o", job_id], timeout=30)
    return dict(item.split("=", 1) for item in done.stdout.split() if "=" in item)


def _hostnames(slurm: SimSlurm, nodelist: str) -> list[str]:
    return slurm.run(["scontrol", "show", "hostnames", nodelist], timeout=30).stdout.split()


@pytest.mark.extended  # about 2 min (a requeue); CI's long lane runs the docs' sbatch script
def test_a_node_that_fails_requeues_the_docs_job_which_resumes_to_the_same_weights(slurm, tmp_path):
    """Issue 56: kill every process of one node of a running 2 x 2 job (its slurmd, torchrun's
    agent, two ranks). SLURM marks the node DOWN and requeues the job onto the two healthy nodes;
    it resumes from the newest complete checkpoint and ends with the uninterrupted run's weights."""
    import subprocess
    import time

    from safetensors.torch import load_file

    import shardkit.checkpoint as ck

    def args(ckpt: str, export: str) -> str:
        return (f"{RESUME_EXAMPLE} --ckpt-dir {ckpt} --steps {RESUME_STEPS} "
                f"--every {RESUME_EVERY} --export {export}")

    reference = subprocess.run(
        launch_cmd() + ["--nproc", "4", *args(str(tmp_path / "ref-ckpt"), str(tmp_path / "ref")).split()],
        env=_user_env(), cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]

    ckpt, log = str(tmp_path / "ckpt"), tmp_path / "job.out"
    script = _sized(_doc_sbatch_script(requeue=True),
                    ("train.py --ckpt-dir /shared/ckpt", args(ckpt, str(tmp_path / "requeued"))))
    (tmp_path / "train.sbatch").write_text(script)
    done = slurm.run(["sbatch", "--parsable", f"--output={log}", str(tmp_path / "train.sbatch")],
                     timeout=60, **_user_env())
    assert done.returncode == 0, done.stdout
    job_id = done.stdout.strip().split(";")[0]

    deadline = time.monotonic() + TIMEOUT
    while not any(int(os.path.basename(p)[len("step_"):]) >= KILL_AFTER for p in ck.complete(ckpt)):
        said = log.read_text()[-4000:] if log.exists() else "no log yet"
        assert time.monotonic() < deadline, said
        assert "Exited with exit code" not in said, said
        time.sleep(0.1)
    first = _job(slurm, job_id)
    nodes = _hostnames(slurm, first["NodeList"])
    (victim,) = [n for n in nodes if n != first["BatchHost"]]
    assert slurm.fail_node(slurm.names.index(victim))
    killed = time.monotonic()

    state: dict[str, str] = {}
    seen: dict[str, float] = {}  # when each job state was first seen after the kill
    while time.monotonic() < deadline + TIMEOUT:
        state = _job(slurm, job_id)
        seen.setdefault(f"{state['JobState']}{state['Restarts']}", time.monotonic() - killed)
        if state["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            break
        time.sleep(0.5)
    print("after the node was killed, seconds to each job state (state + restarts):",
          {k: round(v, 1) for k, v in seen.items()})
    text = log.read_text()
    assert state["JobState"] == "COMPLETED", f"{state}\n{text[-6000:]}"
    assert state["Restarts"] == "1", state
    assert victim not in _hostnames(slurm, state["NodeList"]), state

    # The log holds both attempts: the survivors' report names the lost ranks' host, SLURM names
    # the node, and the second attempt starts from the newest complete checkpoint.
    first_attempt, _, second_attempt = text.partition("attempt 1 on")
    assert re.search(rf"shardkit: rank [23] \(on {victim}\) stopped responding", first_attempt), \
        first_attempt[-4000:]
    # Every rank that spoke names the lost node, also one its launcher stopped after a peer
    # reported (its own check could not see the lost ranks yet: within their heartbeat timeout).
    reports = re.findall(r"^shardkit: rank .*$", first_attempt, re.M)
    assert reports and all(f"(on {victim})" in line for line in reports), reports
    assert f"Node failure on {victim}" in first_attempt, first_attempt[-4000:]
    resumed = re.search(r"resumed from \S+ at step (\d+)", second_attempt)
    assert resumed and KILL_AFTER <= int(resumed.group(1)) < RESUME_STEPS, second_attempt[-4000:]
    # Killed mid-run: at or past the checkpoint it resumed from, short of the end.
    ran_first = max(int(s) for s in re.findall(r"^step (\d+) loss", first_attempt, re.M))
    assert int(resumed.group(1)) <= ran_first < RESUME_STEPS, (resumed.group(1), ran_first)

    _same_weights(load_file(str(tmp_path / "requeued" / "model.safetensors")),
                  load_file(str(tmp_path / "ref" / "model.safetensors")))

    slurm.restore_node(slurm.names.index(victim))  # for any test after this one
