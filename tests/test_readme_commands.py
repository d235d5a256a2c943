"""README's commands are the ones that run: CI runs its test line verbatim, the quick start is a file."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", README, flags=re.S)


def test_ci_runs_the_readme_test_command_verbatim():
    test_lines = [line for block in _bash_blocks() for line in block.splitlines()
                  if "python -m pytest" in line and "not slow" not in line]
    assert len(test_lines) == 1, test_lines
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_lines[0] in ci_lines, test_lines[0]


def test_no_readme_command_lets_pip_choose_torch():
    # On Linux an index-less torch install takes a CUDA build of several GB; only CI's own line,
    # on a machine with the CPU wheel on disk, may leave the index out, and says so.
    commands = list(re.finditer(r"`(pip install\s+torch[^`]*)`", README))
    assert len(commands) >= 5
    for found in commands:
        if "--index-url" not in found.group(1):
            assert "CI" in README[found.start() - 120:found.start()], found.group(1)
    for block in _bash_blocks():
        assert "pip install torch" not in block, block  # torch is step 1 of the install table


def test_the_quick_start_is_examples_quickstart_verbatim():
    first = re.search(r"```python\n(.*?)```", README, flags=re.S).group(1)
    assert first == (ROOT / "examples" / "quickstart.py").read_text()


@pytest.mark.slow
@pytest.mark.long
def test_the_quick_start_runs_as_the_readme_says(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                        "MASTER_PORT", "SHARDKIT_BACKEND")}
    out = subprocess.run([sys.executable, "-m", "shardkit", "launch", "--nproc", "2",
                          str(ROOT / "examples" / "quickstart.py")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    means = [float(m) for m in re.findall(r"step \d+, 2 ranks: mean loss ([\d.]+)", out.stdout)]
    assert len(means) == 5 and means[-1] < 0.5 * means[0], out.stdout
    # Threads are set once, deliberately, and said in one line; torchrun's banner is gone.
    assert "Setting OMP_NUM_THREADS" not in out.stderr, out.stderr
    assert out.stderr.count("shardkit launch: OMP_NUM_THREADS=") == 1, out.stderr
    saved = torch.load(tmp_path / "quickstart-ckpt" / "shardkit_state.pt", weights_only=False)
    assert saved["extra"] == {"step": 100}, saved.keys()


def _collected(*marker_args: str) -> set[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", *marker_args], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return {line for line in out.stdout.splitlines() if "::" in line}


@pytest.mark.long  # five collections of the whole suite: about 55 s on 2 cores
def test_each_documented_lane_selects_what_its_text_says():
    # Getting started names four lanes: the README command (no -m: every test but the long and
    # extended ones), CI's long lane (-m long), the extended lane (-m extended: the rest of the
    # long tables, run before each submission) and the quick lane (-m "not slow").
    # A command-line -m replaced addopts' 'not long' once, so the quick lane ran the long lane.
    default, long_lane, quick = _collected(), _collected("-m", "long"), _collected("-m", "not slow")
    extended, everything = _collected("-m", "extended"), _collected("-m", "long or extended or not long")
    assert len(long_lane) > 50 and len(extended) > 20 and len(default) > 500
    assert not default & long_lane and not default & extended and not long_lane & extended
    assert not quick & (long_lane | extended), sorted(quick & (long_lane | extended))[:5]
    assert quick < default
    # Nothing falls between the lanes: together they are every test.
    assert default | long_lane | extended == everything, sorted(everything - default - long_lane - extended)[:5]
