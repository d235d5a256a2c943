"""benchmarks/soak.py (issue 55): what counts as a failed run, and what is kept of one."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("soak", ROOT / "benchmarks" / "soak.py")
soak = importlib.util.module_from_spec(_spec)
sys.modules["soak"] = soak  # the frozen dataclass resolves its module by name
_spec.loader.exec_module(soak)


def _scenario(code: str, timeout_s: float = 60.0):
    return soak.Scenario("t", (soak._py("-c", code),), timeout_s=timeout_s)


def test_a_run_passes_only_when_every_process_ends_cleanly(tmp_path):
    passed, seconds, why = soak.run_once(_scenario("print('fine')"), tmp_path / "ok")
    assert (passed, why) == (True, "") and seconds > 0
    assert soak.run_once(_scenario("raise SystemExit(3)"), tmp_path / "rc")[2] == "exit 3"
    # a launcher that exits 0 while a rank it started printed the abort (Lightning's rank 1)
    said = "import sys; sys.stderr.write('terminate called without an active exception\\n')"
    assert soak.run_once(_scenario(said), tmp_path / "said")[2] == "a process printed 'terminate called'"
    why = soak.run_once(_scenario("import time; time.sleep(30)", timeout_s=1), tmp_path / "slow")[2]
    assert why == "timed out after 1 s"


def test_every_documented_scenario_has_its_files_and_scripts():
    for scenario in soak.SCENARIOS.values():
        for command in scenario.commands:
            scripts = [a for a in command if a.endswith(".py")]
            for script in scripts:
                assert (Path(script).exists() or script in dict(scenario.files)), (scenario.name, script)


@pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb is not installed")
def test_an_aborted_run_keeps_its_core_and_every_threads_backtrace(tmp_path):
    folder = tmp_path / "abort"
    passed, _, why = soak.run_once(_scenario("import os; os.abort()"), folder)
    assert (passed, why) == (False, "exit -6")
    if not list(folder.glob("core*")):
        pytest.skip("this machine writes core files elsewhere (kernel.core_pattern)")
    soak._backtraces(folder)
    assert "raise" in (folder / "backtrace.txt").read_text()
