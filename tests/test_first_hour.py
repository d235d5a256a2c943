"""What a newcomer meets in the first hour (issue 18): pipes, typos, a missing script, the plan's
numbers and the error classes the README names, each as the user sees it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardkit
from shardkit.install_hint import pip_install_extra

ROOT = Path(__file__).resolve().parents[1]
FACTORY = "_planner_models:llama2_7b_shape"


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    # From tests/, so `plan` finds the factories of tests/_planner_models.py.
    return subprocess.run([sys.executable, "-m", "shardkit.cli.main", *args], cwd=ROOT / "tests",
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("args", [("info", "--json"), ("plan", FACTORY, "--world-size", "2",
                                                       "--json")])
def test_a_closed_pipe_ends_the_command_quietly(args):
    # What `shardkit info --json | head -1` does: the reader is gone before the output is written.
    proc = subprocess.Popen([sys.executable, "-m", "shardkit.cli.main", *args], cwd=ROOT / "tests",
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    err = proc.stderr.read()
    proc.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert proc.returncode in (0, 141), (proc.returncode, err)


def test_typos_get_a_suggestion():
    with pytest.raises(shardkit.BackendNotFoundError, match=r"unknown backend 'cdua'; did you "
                                                            r"mean 'cuda'\?"):
        shardkit.get_backend("cdua")
    with pytest.raises(shardkit.ShardkitError, match=r"unknown sharding strategy 'FULL_SHRAD'; "
                                                     r"did you mean 'FULL_SHARD'\?"):
        shardkit.ShardingStrategy.parse("FULL_SHRAD")
    out = _cli("infoo")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        "shardkit: error: unknown command 'infoo'; did you mean 'info'? Commands: info, launch, "
        "consolidate, inspect, demo, plan (shardkit --help)")


def test_a_wrong_backend_in_the_environment_still_lists_every_backend():
    out = _cli("info", env={"SHARDKIT_BACKEND": "cdua"})
    text = out.stdout + out.stderr
    for name in ("cpu", "cuda", "xpu", "xla"):
        assert f"{name}" in text, text
    assert "SHARDKIT_BACKEND='cdua'" in text and "did you mean 'cuda'?" in text, text


def test_launch_refuses_a_script_that_does_not_exist_in_one_line(tmp_path):
    out = _cli("launch", "--backend", "cpu", "--nproc", "2", str(tmp_path / "missing.py"))
    assert out.returncode == 2
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert lines == [f"shardkit launch: error: no such script: {tmp_path / 'missing.py'}"], lines


def test_plan_sizes_just_under_a_gib_read_as_mib_and_json_has_no_empty_dtype():
    from shardkit.planner.result import _size

    assert _size(999.4 * 2**20) == "999 MiB"
    assert _size(1000 * 2**20) == "1000 MiB"
    assert _size(1023.4 * 2**20) == "1023 MiB"
    assert _size(1024 * 2**20) == "1 GiB"
    assert _size(1.5 * 2**30) == "1.5 GiB"
    import json

    out = _cli("plan", FACTORY, "--world-size", "2", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["param_dtype"] is None


def test_a_hybrid_hint_names_the_cli_flag_too():
    out = _cli("plan", FACTORY, "--world-size", "4", "--strategy",
               "HYBRID_SHARD", "--hybrid-group-size", "3")
    assert out.returncode == 1
    assert "--hybrid-group-size" in out.stderr, out.stderr


def test_every_error_class_the_readme_names_is_importable_from_shardkit():
    from shardkit import (BackendNotFoundError, BackendUnavailableError,  # noqa: F401
                          CheckpointError, CheckpointNotFoundError, CollectiveOrderError,
                          CorruptCheckpointError, IncompleteCheckpointError, JobStoreError,
                          PeerFailedError, PluginLoadError, ShardkitError, SpawnError,
                          StateDictMismatchError, UnsupportedOperationError)

    for cls in (SpawnError, CollectiveOrderError, CheckpointError, JobStoreError):
        assert issubclass(cls, ShardkitError) and cls.__name__ in shardkit.__all__
    readme = "".join(p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
    for name in ("SpawnError", "CollectiveOrderError", "CheckpointNotFoundError", "CheckpointError",
                 "PeerFailedError"):
        assert name in readme


def test_demo_without_scikit_learn_says_so_in_one_line_before_starting_ranks(tmp_path):
    # A stand-in package that fails to import the way a missing scikit-learn does.
    (tmp_path / "sklearn").mkdir()
    (tmp_path / "sklearn" / "__init__.py").write_text(
        "raise ImportError(\"No module named 'sklearn'\")\n")
    out = _cli("demo", "--epochs", "1", env={"PYTHONPATH": str(tmp_path)})
    assert out.returncode == 1
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert lines == ["shardkit: error: the demo trains on scikit-learn's bundled digits, but "
                     f"scikit-learn is not installed. HINT: {pip_install_extra('examples')}"], lines


def test_the_demo_offers_only_models_it_can_train_and_shows_every_default():
    out = _cli("demo", "--help")
    assert out.returncode == 0
    assert "--model {shallow,deep,mlp}" in out.stdout and "gpt" not in out.stdout
    for flag in ("--nproc", "--strategy", "--model", "--epochs", "--mixed-precision",
                 "--batch-size", "--optimizer", "--seed"):
        section = out.stdout.split(f"  {flag}", 1)[1].split("\n  --", 1)[0]
        assert "(default: " in section, (flag, section)
    assert _cli("demo", "--model", "gpt-tiny").returncode == 2  # refused by the parser


@pytest.mark.parametrize("library, backend", [("gloo", "cpu"), ("nccl", "cuda")])
def test_torchs_collective_name_as_a_backend_names_the_backend_meant(library, backend):
    # torch's init_process_group("gloo") habit: the answer is the backend that runs on it.
    with pytest.raises(shardkit.BackendNotFoundError,
                       match=rf"unknown backend '{library}': '{library}' is torch's name for a "
                             rf"collective library.*HINT: backend='{backend}' runs on {library}"):
        shardkit.get_backend(library)


def test_a_checkpoint_path_with_a_typo_names_the_checkpoints_nearby(tmp_path):
    # Issue 57: checkpoint.load("ckpt/step_000039") where the folder is ckpts/ said only "no
    # checkpoint at <path>".
    from shardkit.checkpoint.manifest import MANIFEST_FILE

    for step in ("step_000019", "step_000039"):
        (tmp_path / "ckpts" / step).mkdir(parents=True)
        (tmp_path / "ckpts" / step / MANIFEST_FILE).write_text("{}")
    (tmp_path / "logs" / "step_000039").mkdir(parents=True)  # a folder, not a checkpoint
    with pytest.raises(shardkit.CheckpointNotFoundError) as err:
        shardkit.checkpoint.load(str(tmp_path / "ckpt" / "step_000039"), torch.nn.Linear(2, 2))
    message = str(err.value)
    hint = message[message.index("HINT: complete checkpoints nearby: "):]
    assert hint.split("nearby: ", 1)[1].startswith(str(tmp_path / "ckpts" / "step_000039") + ", "
                                             + str(tmp_path / "ckpts" / "step_000019")), message
    assert "logs" not in hint
    with pytest.raises(shardkit.CheckpointNotFoundError) as err:
        shardkit.checkpoint.load(str(tmp_path / "elsewhere" / "x" / "y"), torch.nn.Linear(2, 2))
    assert "HINT" not in str(err.value)


_NO_LAUNCHER = """
import shardkit, sys
cpu = type(shardkit.get_backend("cpu"))
if sys.argv[1] == "devices":  # a backend with 4 devices here, as a 4-GPU machine has
    cpu.max_local_ranks = lambda self: 4
ctx = shardkit.init(backend="cpu")
print("world", ctx.world_size, flush=True)
shardkit.shutdown()
"""


@pytest.mark.parametrize("devices", ["devices", "cores"])
def test_a_script_run_without_a_launcher_says_so_where_it_could_use_more_devices(devices, tmp_path):
    # Issue 57: `python train.py` trained silently on one rank. One line where the backend has
    # several devices here; silent on the cpu backend, where one rank is a normal choice.
    script = tmp_path / "train.py"
    script.write_text(_NO_LAUNCHER)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "SHARDKIT_BACKEND", "SHARDKIT_LOG")}
    out = subprocess.run([sys.executable, str(script), devices], capture_output=True, text=True,
                         timeout=120, env=env, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout == "world 1\n", out
    said = [line for line in out.stderr.splitlines() if line.strip()]
    if devices == "cores":
        assert said == [], out.stderr
    else:
        assert len(said) == 1 and "no launcher found" in said[0], out.stderr
        assert said[0].endswith("HINT: shardkit launch --nproc 4 train.py"), said
