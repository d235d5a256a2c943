"""`shardkit launch`: argument splitting, backend errors, and real torchrun runs (one node and two)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from shardkit.cli import launch
from shardkit.job.spawn import free_port

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "ddp_replicate.py"
TIMEOUT = 240


def launch_cmd() -> list[str]:
    """How a user runs `shardkit launch` from this checkout's environment."""
    return [sys.executable, "-m", "shardkit.cli.main", "launch"]


def child_env() -> dict[str, str]:
    """The test environment without launcher variables a parent job might have set."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "SHARDKIT_BACKEND")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    """Run `shardkit launch ARGS` to completion and return the finished process."""
    return subprocess.run(launch_cmd() + args, env=child_env(), capture_output=True, text=True,
                          timeout=TIMEOUT, cwd=ROOT, **kwargs)


# ---- splitting the command line (no processes) --------------------------------------------------
def test_dry_run_shows_torchrun_with_launcher_options_and_untouched_script_args(capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice: shardkit adds nothing
    argv = ["--backend", "cpu", "--nproc", "2", "--dry-run", "--nnodes", "2", "--node-rank=1",
            "--master-addr", "127.0.0.1", "--master-port", "1234", "--standalone", "train.py",
            "--nproc", "9", "--backend", "gpu", "-x"]
    assert launch.main(argv) == 0
    env_part, _, cmd = capsys.readouterr().out.strip().partition(" ")
    assert env_part == "SHARDKIT_BACKEND=cpu"
    assert cmd.split() == [sys.executable, "-m", "shardkit.cli.launch_agent", "--nproc-per-node=2",
                           "--nnodes", "2", "--node-rank=1", "--master-addr", "127.0.0.1",
                           "--master-port", "1234", "--standalone", "--",
                           "train.py", "--nproc", "9", "--backend", "gpu", "-x"]


def test_double_dash_separates_the_script():
    req = launch.split_argv(["--nproc=3", "--", "-weird-script.py", "--a"])
    assert (req.nproc, req.launcher_args, req.script_argv) == ("3", [], ["-weird-script.py", "--a"])


def test_cpu_defaults_to_one_rank_per_node(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    command, env = launch.build_command(launch.split_argv(["--backend", "cpu", "t.py"]))
    assert "--nproc-per-node=1" in command and command[-1] == "t.py"
    assert env == {"SHARDKIT_BACKEND": "cpu"}


def test_threads_per_rank_split_the_usable_cores_unless_the_user_chose():
    assert launch.thread_env(2, {}, cores=16) == {"OMP_NUM_THREADS": "8"}
    assert launch.thread_env(3, {}, cores=16) == {"OMP_NUM_THREADS": "5"}
    assert launch.thread_env(4, {}, cores=2) == {"OMP_NUM_THREADS": "1"}
    assert launch.thread_env(2, {"OMP_NUM_THREADS": "7"}, cores=16) == {}


@pytest.mark.parametrize("argv, message", [
    (["--frob", "1", "t.py"], "unknown launcher option '--frob'"),
    (["--nnodes"], "launcher option --nnodes needs a value"),
    (["--nproc", "two", "t.py"], "--nproc must be a positive integer, got 'two'"),
    (["--nproc", "2"], "no training script given"),
])
def test_bad_command_lines_say_what_is_wrong(argv, message, capsys):
    assert launch.main(argv) == 2
    assert message in capsys.readouterr().err


def test_unknown_backend_is_a_clear_error():
    result = run(["--backend", "nosuch", "--nproc", "1", "t.py"])
    assert result.returncode == 2
    assert "shardkit launch: error: unknown backend 'nosuch'" in result.stderr
    assert "- cpu: available" in result.stderr  # it lists what is registered


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch is a CUDA build")
def test_unavailable_backend_says_how_to_get_it(capsys):
    assert launch.main(["--backend", "cuda", "t.py"]) == 2
    err = capsys.readouterr().err
    assert "backend 'cuda' is not available: torch" in err and "HINT:" in err


# ---- real launches --------------------------------------------------------------------------------
DUMP_SCRIPT = textwrap.dedent("""
    import json, os, sys
    out = os.path.join(sys.argv[1], "rank" + os.environ["RANK"] + ".json")
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SHARDKIT_BACKEND")
    json.dump({"argv": sys.argv[2:], **{k: os.environ.get(k) for k in keys}}, open(out, "w"))
""")


@pytest.mark.slow
def test_script_arguments_pass_through_untouched(tmp_path):
    script = tmp_path / "dump.py"
    script.write_text(DUMP_SCRIPT)
    result = run(["--nproc", "1", "--master-port", str(free_port()), str(script), str(tmp_path),
                  "--nproc", "7", "--master-port", "1", "plain"])
    assert result.returncode == 0, result.stderr
    info = json.loads((tmp_path / "rank0.json").read_text())
    assert info == {"argv": ["--nproc", "7", "--master-port", "1", "plain"], "RANK": "0",
                    "WORLD_SIZE": "1", "LOCAL_RANK": "0", "SHARDKIT_BACKEND": "cpu"}


@pytest.mark.slow
@pytest.mark.long
def test_two_nodes_on_one_machine_equal_one_node_of_the_same_world_size(tmp_path):
    steps = ["--steps", "6"]
    port = str(free_port())
    nodes = [subprocess.Popen(launch_cmd() + [
        "--nnodes", "2", "--nproc", "1", "--node-rank", str(node), "--master-addr", "127.0.0.1",
        "--master-port", port, str(EXAMPLE), *steps, "--save", str(tmp_path / f"two-nodes-{node}.pt")],
        env=child_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in (0, 1)]
    logs = [p.communicate(timeout=TIMEOUT)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(logs)
    single = run(["--nproc", "2", "--master-port", str(free_port()), str(EXAMPLE), *steps,
                  "--save", str(tmp_path / "one-node.pt")])
    assert single.returncode == 0, single.stderr

    # Only global rank 0 saves, and node 0 hosts rank 0.
    assert not (tmp_path / "two-nodes-1.pt").exists()
    two = torch.load(tmp_path / "two-nodes-0.pt")
    one = torch.load(tmp_path / "one-node.pt")
    assert two["world_size"] == one["world_size"] == 2
    assert len(two["losses"]) == 6 and two["losses"][-1] < two["losses"][0]
    diff = max((two["state"][k] - one["state"][k]).abs().max().item() for k in one["state"])
    assert diff <= 1e-7, f"two-node vs one-node weights differ by {diff}"
    assert max(abs(a - b) for a, b in zip(two["losses"], one["losses"])) <= 1e-7
