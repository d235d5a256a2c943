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
    with SimSlurm(2, str(tmp_path_factory.mktemp("slurm"))) as cluster:
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
    assert ours[1].keys() == theirs[1].keys()
    for name, value in ours[1].items():
        assert torch.equal(value, theirs[1][name]), name


def _user_env() -> dict[str, str]:
    env = child_env()
    env.update(OMP_NUM_THREADS="1")
    return env


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


def _doc_sbatch_script() -> str:
    with open(PAGE) as f:
        page = f.read()
    blocks = re.findall(r"```bash\n(.*?)```", page, re.S)
    (script,) = [b for b in blocks if DOC_LAUNCH in b]
    return script


def test_the_docs_sbatch_script_trains_as_torchrun(slurm, torchrun_reference, tmp_path):
    out = str(tmp_path / "sbatch.json")
    script = _doc_sbatch_script()
    # The page's script as it is, sized to these nodes (2 CPUs and 2 ranks each), running the
    # test's training script in place of train.py.
    for page_text, here in (("--cpus-per-task=32", "--cpus-per-task=2"),
                            ("--nproc 8", "--nproc 2"),
                            ("train.py", f"{SCRIPT} {out} FULL_SHARD {STEPS}")):
        assert page_text in script, page_text
        script = script.replace(page_text, here)
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
