"""docs/coming-from.md's port: the FSDP2 script and its shardkit port train alike, bit for bit.

Both files are shown verbatim in the docs (`same-as` markers); each runs here as its users run it
(torchrun and `shardkit launch`, 2 ranks), and the other's checkpoint format is read back too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _torch_exit_abort import run_reference

ROOT = Path(__file__).resolve().parents[1]
PORT = ROOT / "examples" / "from_fsdp2"


def _run(launcher: list[str], script: str, out: Path) -> list[float]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "SHARDKIT_BACKEND")}
    env["OMP_NUM_THREADS"] = "1"
    # torch's own abort at exit, in the plain FSDP2 script (no shardkit in the process),
    # after destroy_process_group(): tests/_torch_exit_abort.py. Only the reference reruns.
    done = run_reference(
        lambda: subprocess.run([sys.executable, "-m", *launcher, str(PORT / script), str(out)],
                               capture_output=True, text=True, timeout=300, env=env, cwd=out),
        script == "fsdp2_train.py", "torch's FSDP2 reference")
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    return [float(x) for x in re.findall(r"step \d+: loss ([\d.]+)", done.stdout)]


def _weights(model_dir: Path, fmt: str) -> dict[str, torch.Tensor]:
    """The whole model a checkpoint holds, read in this one process."""
    import torch.distributed.checkpoint as dcp

    import shardkit.checkpoint

    namespace: dict = {}
    source = (PORT / "shardkit_train.py").read_text()
    exec(source[:source.index("ctx = shardkit.init()")], namespace)  # the Block class
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), *[namespace["Block"](64) for _ in range(4)],
                                torch.nn.Linear(64, 4))
    if fmt == "dcp":
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=str(model_dir))
        model.load_state_dict(state["model"])
    else:  # offline, as a user without a job would: safetensors files
        from safetensors.torch import load_file

        out = shardkit.checkpoint.consolidate(model_dir, model_dir.parent / "consolidated")
        model.load_state_dict({k: v for f in sorted(Path(out).glob("*.safetensors"))
                               for k, v in load_file(f).items()})
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.long  # two 2-rank jobs: about 30 s on 2 cores
def test_the_fsdp2_script_and_its_port_train_alike(tmp_path):
    fsdp2 = _run(["torch.distributed.run", "--nproc-per-node", "2"], "fsdp2_train.py", tmp_path)
    ported = _run(["shardkit", "launch", "--nproc", "2"], "shardkit_train.py", tmp_path)
    assert len(fsdp2) == 3 and ported == fsdp2, (fsdp2, ported)  # printed to 6 decimals
    theirs, ours = _weights(tmp_path / "dcp", "dcp"), _weights(tmp_path / "ckpt", "shardkit")
    worst = max((theirs[n] - ours[n]).abs().max().item() for n in theirs)
    print(f"losses {ported}; worst weight difference after 30 AdamW steps {worst:.2e}")
    assert worst <= 1e-6, worst
