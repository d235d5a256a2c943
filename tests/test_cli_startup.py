"""The `shardkit` command starts fast, takes -v, lists its environment, and ends quietly on Ctrl-C."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import shardkit
from shardkit.cli.args import STRATEGY_NAMES
from shardkit.cli.main import COMMANDS

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_of_every_command_needs_no_torch(command):
    # torch takes seconds to import; parsing and --help must not wait for it.
    argv = [command, "--help"] if command else ["--help"]
    out = _python("import sys, contextlib, io\n"
                  "from shardkit.cli.main import main\n"
                  "with contextlib.redirect_stdout(io.StringIO()) as text:\n"
                  "    try:\n"
                  f"        main({argv!r})\n"
                  "    except SystemExit:\n"
                  "        pass\n"
                  "assert 'usage' in text.getvalue(), text.getvalue()\n"
                  "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))[:3])")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_import_shardkit_is_lazy_and_the_names_resolve_to_what_the_type_checkers_see():
    out = _python("import sys, shardkit\n"
                  "print('torch' in sys.modules)\n"
                  "import shardkit.job.spawn, shardkit.replicate\n"
                  "print(callable(shardkit.spawn), callable(shardkit.replicate))")
    assert out.stdout.split() == ["False", "True", "True"], out.stdout + out.stderr
    tree = ast.parse(Path(shardkit.__file__).read_text())
    typed = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            for stmt in node.body:
                for alias in stmt.names:
                    module = "." * stmt.level + (stmt.module or "")
                    typed[alias.asname or alias.name] = (
                        (module, alias.name) if stmt.module else ("." + alias.name, ""))
    assert typed == shardkit._LAZY
    for name in shardkit._LAZY:
        assert getattr(shardkit, name) is not None
    assert len(shardkit.__all__) == len(set(shardkit.__all__)) and set(shardkit._LAZY) <= set(shardkit.__all__)
    assert all(hasattr(shardkit, name) for name in shardkit.__all__)


def test_names_spelled_out_for_parsing_match_the_library():
    from shardkit.checkpoint.cli import MAX_SHARD_SIZE_DEFAULT
    from shardkit.checkpoint.safetensors_io import DEFAULT_MAX_SHARD_SIZE

    assert STRATEGY_NAMES == tuple(s.name for s in shardkit.ShardingStrategy)
    assert MAX_SHARD_SIZE_DEFAULT == DEFAULT_MAX_SHARD_SIZE


def test_help_lists_the_environment_and_v():
    out = subprocess.run([sys.executable, "-m", "shardkit", "--help"], capture_output=True,
                         text=True, timeout=60)
    for name in ("SHARDKIT_LOG", "SHARDKIT_DEBUG", "SHARDKIT_TIMEOUT", "SHARDKIT_BACKEND", "-v"):
        assert name in out.stdout, out.stdout
    for command in ("demo", "plan"):
        sub = subprocess.run([sys.executable, "-m", "shardkit", command, "--help"],
                             capture_output=True, text=True, timeout=60)
        assert "SHARDKIT_TIMEOUT=SECONDS" in sub.stdout, sub.stdout


@pytest.mark.slow
@pytest.mark.long
def test_v_after_the_command_logs_what_shardkit_decides(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("SHARDKIT_LOG", None)
    out = subprocess.run([sys.executable, "-m", "shardkit", "demo", "-v", "--epochs", "1",
                          "--limit-train", "64", "--no-progress", "--nproc", "2"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "[shardkit INFO" in out.stderr and "sharded ShallowNet with FULL_SHARD" in out.stderr



def test_launch_v_sets_the_log_level_for_every_rank():
    from shardkit.cli import launch

    _, env = launch.build_command(launch.split_argv(["-vv", "--backend", "cpu", "t.py", "-v"]))
    assert env["SHARDKIT_LOG"] == "debug"
    req = launch.split_argv(["--backend", "cpu", "t.py", "-v"])
    assert (req.verbose, req.script_argv) == (0, ["t.py", "-v"])  # the script's own -v


@pytest.mark.slow
@pytest.mark.parametrize("after", [0.3, pytest.param(4.0, marks=pytest.mark.long),
                                   pytest.param(9.0, marks=pytest.mark.long)])
def test_ctrl_c_ends_the_demo_quietly_with_130(after, tmp_path):
    # Ctrl-C in a terminal signals the whole foreground process group: the command, the
    # forkserver and every rank. Sent while starting, while ranks import and while training.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "shardkit", "demo", "--epochs", "5",
                             "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=tmp_path, start_new_session=True,
                            preexec_fn=as_in_a_terminal)
    time.sleep(after)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out, err)
    assert err.strip() == "shardkit demo: interrupted", err
    assert "Traceback" not in out + err and "leaked" not in err
    # No rank and no forkserver left behind: a forkserver caught importing torch finishes that
    # first (it ignores Ctrl-C), then sees its caller gone; ranks end with their caller.
    deadline = time.monotonic() + 15.0
    while time.monotonic() < deadline:
        leftovers = subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True)
        if not leftovers.stdout:
            break
        time.sleep(0.2)
    assert leftovers.stdout == "", subprocess.run(["ps", "-o", "pid,etime,args", "-s",
                                                   str(proc.pid)], capture_output=True,
                                                  text=True).stdout
    print(f"Ctrl-C at {after} s: every process gone {15.0 - (deadline - time.monotonic()):.1f} s "
          "after the command exited")


def as_in_a_terminal() -> None:
    """A command started from a terminal answers Ctrl-C; one started by a background job of a
    non-interactive shell (as CI may run us) inherits SIGINT ignored: undo that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _sigint_state(rank: int) -> tuple[bool, bool]:
    """(SIGINT ignored, SIGINT blocked) in a rank."""
    return (signal.getsignal(signal.SIGINT) is signal.SIG_IGN,
            signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))


CTRL_C_WHILE_STARTING = """
import os, signal, subprocess, sys, time
from shardkit.job.spawn import _ctrl_c_left_to_caller
try:
    with _ctrl_c_left_to_caller():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
        child = subprocess.run([sys.executable, "-c", "import signal; print(signal.getsignal("
                                "signal.SIGINT) is signal.SIG_IGN)"], capture_output=True, text=True)
        print("pending; child ignores:", child.stdout.strip(), flush=True)
    time.sleep(0.1)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def test_a_ctrl_c_while_ranks_start_reaches_the_caller_and_ranks_ignore_it():
    # Spawn and fork start methods: children inherit SIGINT ignored from the caller, which
    # blocks it meanwhile, so a Ctrl-C then stays pending and is raised once its handler is back.
    # One thread (a numpy thread pool could take the signal while it is ignored: README says).
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", CTRL_C_WHILE_STARTING], capture_output=True,
                         text=True, timeout=120, env=env, preexec_fn=as_in_a_terminal)
    assert out.stdout.splitlines() == ["pending; child ignores: True", "interrupted"], out
    # The forkserver ignores it from its first preloaded module on, and so do the ranks it forks;
    # they do not block it: a handler of theirs would run.
    assert shardkit.spawn(_sigint_state, 2) == [(True, False), (True, False)]
    assert shardkit.spawn(_sigint_state, 1, start_method="spawn") == [(True, False)]
