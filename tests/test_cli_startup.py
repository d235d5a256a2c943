"""The `shardkit` command starts fast, takes -v, lists its environment, and ends quietly on Ctrl-C."""

from __future__ import annotations

import ast
import os
import queue
import re
import signal
import subprocess
import tempfile
import sys
import threading
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


_TRAINING_LOOP = """
import os, time, torch
from torch import nn
import shardkit
ctx = shardkit.init()
model = shardkit.shard(nn.Sequential(nn.Linear(16, 64), nn.Linear(64, 4)))
opt = torch.optim.Adam(model.parameters())
os.write(1, f"ready {ctx.rank}\\n".encode())  # one write: ranks share the pipe, unbuffered
while True:
    model(torch.randn(8, 16)).sum().backward(); opt.step(); opt.zero_grad(); time.sleep(0.01)
"""


_LAUNCHED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_job_outlives_its_test():
    """Kill what a test launched if it is still running when the test ends: a failed assertion
    must not leave a training job behind (one left from a failed Ctrl-C test trained for half
    an hour beside the rest of the lane, which then timed out test after test)."""
    yield
    while _LAUNCHED:
        proc = _LAUNCHED.pop()
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)


def _launch(script: Path, nproc: int, env_extra: dict | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "SHARDKIT_BACKEND", "SHARDKIT_DEBUG")}
    env.update({"OMP_NUM_THREADS": "1", **(env_extra or {})})
    proc = subprocess.Popen([sys.executable, "-m", "shardkit", "launch", "--nproc", str(nproc),
                             str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=script.parent, start_new_session=True,
                            preexec_fn=as_in_a_terminal)
    _LAUNCHED.append(proc)
    return proc


@pytest.mark.slow
@pytest.mark.long  # ranks start, train, and are interrupted: about 12 s on 2 cores
@pytest.mark.parametrize("nproc", [2, pytest.param(3, marks=pytest.mark.extended)])
def test_ctrl_c_under_launch_is_one_line_and_exit_130(nproc, tmp_path):
    # Issue 57: a Ctrl-C used to print torchrun's "Received 2 death signal", every rank's
    # KeyboardInterrupt traceback and the agent's SignalException traceback (86-150 lines).
    script = tmp_path / "train.py"
    script.write_text(_TRAINING_LOOP)
    proc = _launch(script, nproc)
    lines: "queue.Queue[str]" = queue.Queue()
    # A reader thread, so the deadline holds even when no line comes (readline would block).
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True)
    reader.start()
    seen: list[str] = []
    deadline = time.monotonic() + 120  # ranks start in 5-15 s here, under load up to ~60 s
    # Counted in the text, not per line: the ranks write unbuffered (torchrun runs `python -u`)
    # to one pipe, and a print() of several words is several writes, so under load one rank's
    # words landed inside another's line ('readyready 0\nready 2\n', then ' 1\n': the test
    # waited for a third line starting with "ready" forever, 2 runs in 9 beside two busy cores).
    # The script now writes each line at once.
    while "".join(seen).count("ready") < nproc:
        assert time.monotonic() < deadline and proc.poll() is None, seen
        try:
            seen.append(lines.get(timeout=1))
        except queue.Empty:
            pass
    print(f"the ranks' ready lines as they came: {''.join(seen)!r}")
    time.sleep(0.5)  # inside the loop's collectives
    os.killpg(proc.pid, signal.SIGINT)
    began = time.monotonic()
    proc.wait(timeout=60)
    reader.join(timeout=10)
    rest = "".join(lines.get() for _ in range(lines.qsize()))
    took = time.monotonic() - began
    said = [line for line in rest.splitlines() if line.strip()]
    assert proc.returncode == 130, rest
    assert said == [f"shardkit launch: interrupted; {nproc} ranks stopped"], rest
    assert took < 30, took  # torchrun's own shutdown grace is 30 s; the ranks need about 1 s
    print(f"{nproc} ranks: Ctrl-C to exit {took:.1f} s")


@pytest.mark.slow
@pytest.mark.long  # ranks start, train, and are stopped: about 10 s on 2 cores
@pytest.mark.parametrize("whom", ["launcher", "group"])
def test_sigterm_from_outside_is_one_line_per_process_and_exit_143(whom, tmp_path):
    # SLURM ends a job step (scancel, a time limit, a node failure's requeue) by SIGTERM to every
    # process of it ("group"); `kill PID` of the launcher is the other way ("launcher"). Before:
    # torch's agent's SignalException traceback (about 30 lines), and each rank said "a launcher
    # does this to every rank once one failed: no failed rank known here" though none failed.
    script = tmp_path / "train.py"
    script.write_text(_TRAINING_LOOP)
    proc = _launch(script, 2)
    assert proc.stdout is not None
    seen = ""
    while seen.count("ready") < 2:
        line = proc.stdout.readline()
        assert line or proc.poll() is None, seen
        seen += line
    time.sleep(0.5)  # inside the loop's collectives
    (os.killpg if whom == "group" else os.kill)(proc.pid, signal.SIGTERM)
    rest, _ = proc.communicate(timeout=90)
    said = [line for line in rest.splitlines() if line.strip()]
    assert proc.returncode == 128 + signal.SIGTERM, rest
    assert "Traceback" not in rest and "death signal" not in rest, rest
    assert said[-1] == ("shardkit launch: stopped by SIGTERM from outside the job (a scheduler's "
                        "cancel, time limit or requeue, or a kill); 2 ranks stopped"), rest
    for line in said[:-1]:  # each rank's own line, if it spoke before it ended
        # Its SIGTERM handler's, or its watchdog's when a peer's SIGTERM was read first (a rank
        # blocked in a collective runs Python's handler only once the collective returns).
        assert re.match(r"shardkit: rank [01] was terminated \(SIGTERM; from its launcher or a "
                        r"scheduler; no rank is known to have failed", line) or re.match(
            r"shardkit: rank [01] was terminated by SIGTERM \(from its launcher or a scheduler"
            r".*HINT: nothing failed in training", line), rest


_SAME_MISTAKE = """
import torch
from torch import nn
import shardkit
shardkit.init()
shardkit.shard(nn.Linear(4, 4), strategy="FULL_SAHRD")
"""


@pytest.mark.slow
@pytest.mark.long  # 20 s without debug in the default lane on 2 cores (2026-11-29)
@pytest.mark.parametrize("debug", [False, pytest.param(True, marks=pytest.mark.extended)])
def test_an_error_every_rank_raises_prints_once_then_the_summary_with_its_text(debug, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_SAME_MISTAKE)
    proc = _launch(script, 3, {"SHARDKIT_DEBUG": "1"} if debug else None)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 1, out
    error = "unknown sharding strategy 'FULL_SAHRD'; did you mean 'FULL_SHARD'?"
    summary = out[out.index("shardkit launch: train.py failed"):].splitlines()
    assert len(summary) == 4 and error in summary[1] and "(the root cause)" in summary[1], out
    tracebacks = out.count("Traceback (most recent call last)")
    if debug:  # every rank's, with shardkit's frames
        assert tracebacks == 3 and "policies.py" in out, out
        return
    before = out[:out.index("shardkit launch: train.py failed")].splitlines()
    # A rank still on its way to the same mistake when a peer posted its own (a slow start
    # under load: 1 run in 10 beside two busy cores) reports that peer in one line instead: it
    # cannot know it would have made the same mistake. It then waits for the peers that raised
    # to exit first, so the launcher names one of them the root cause, and nobody's report is
    # cut short by the launcher's SIGTERM ("was terminated").
    survivors = [line for line in before if "stops too" in line]
    assert all(line.startswith("shardkit: rank ") and f"raised ShardkitError: {error}" in line
               for line in survivors), out
    assert "stops too" not in summary[1] and "was terminated" not in out, out
    said = out.count(error) - sum(line.count(error) for line in survivors)
    assert tracebacks == 1 and said == 2, out  # the traceback's and the summary's
    assert "policies.py" not in out and "closing signal" not in out, out
    # The threads line, the user's frame, the error, the note (and any such survivor's line).
    assert len(before) <= 8 + len(survivors), out
    print(f"ranks that reported a peer's same error: {len(survivors)}")
    assert not list(Path(tempfile.gettempdir()).glob(f"shardkit-errors-{proc.pid}-*"))


@pytest.mark.slow
@pytest.mark.long  # a 2-rank launch: about 7 s on 2 cores
def test_a_wrong_backend_name_in_init_is_said_once_and_reaches_the_summary(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import shardkit\nshardkit.init(backend='gloo')\n")
    proc = _launch(script, 2)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out
    assert out.count("Traceback (most recent call last)") == 1, out
    summary = out[out.index("shardkit launch: train.py failed"):].splitlines()
    assert "BackendNotFoundError: unknown backend 'gloo'" in summary[1], out
    assert "HINT: backend='cpu' runs on gloo" in summary[1], out
    # Both ranks raise it in init(), before there is a job to tell peers through: whichever
    # exits first is the root cause (rank 1 once in a long lane that shared this 2-core VM with
    # other jobs), and the other raised the same error or was stopped first.
    first = int(re.match(r"\s*rank (\d)", summary[1]).group(1))
    assert (summary[2].endswith("exited with status 1: the same error")
            or summary[2].endswith(f"was stopped by torchrun (SIGTERM) after rank {first} failed")), out


def test_the_same_error_is_said_once_per_job_not_once_per_parent(monkeypatch):
    # Jobs that share a parent (every shardkit.spawn call of one process) each report their
    # own ranks' error: the marker is the job's, not the parent's.
    from shardkit.failure import same_error

    error = ValueError(f"the same words {time.time()}")
    monkeypatch.setenv("SHARDKIT_JOB_ID", f"shardkit.spawn/first-{os.getpid()}")
    assert same_error.first_to_report(error) and not same_error.first_to_report(error)
    monkeypatch.setenv("SHARDKIT_JOB_ID", f"shardkit.spawn/second-{os.getpid()}")
    assert same_error.first_to_report(error)
