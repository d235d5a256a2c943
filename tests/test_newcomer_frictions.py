"""What a newcomer tripped over, each fixed: typos answered by the command, a logged global loss,
`extra` read without a model, a short `shardkit info`, a short launch failure, no `build/` folder."""

from __future__ import annotations

import configparser
import re
import types
from pathlib import Path

import pytest

import shardkit
from shardkit.cli.launch_agent import describe_failures
from shardkit.cli.main import main

ROOT = Path(__file__).resolve().parents[1]


def _cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    try:
        status = main(list(argv))
    except SystemExit as exc:  # argparse's error() exits 2
        status = exc.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_a_mistyped_flag_is_answered_by_the_command_with_a_guess(capsys):
    status, _, err = _cli(capsys, "demo", "--modle", "mlp")
    assert status == 2
    assert err.startswith("usage: shardkit demo "), err  # the demo's usage, not the top level's
    assert err.rstrip().endswith("shardkit demo: error: unrecognized arguments: '--modle' "
                                 "(did you mean '--model'?), 'mlp'"), err
    status, _, err = _cli(capsys, "info", "--jsn")
    assert status == 2 and "unrecognized argument: '--jsn' (did you mean '--json'?)" in err, err


def test_a_mistyped_choice_gets_did_you_mean(capsys):
    status, _, err = _cli(capsys, "demo", "--strategy", "FULLSHARD")
    assert status == 2
    assert err.rstrip().endswith("(choose from 'FULL_SHARD', 'SHARD_GRAD_OP', 'NO_SHARD', "
                                 "'HYBRID_SHARD'); did you mean 'FULL_SHARD'?"), err
    status, _, err = _cli(capsys, "plan", "--world-size", "2", "--mixed-precision", "bf61", "x:y")
    assert status == 2 and "did you mean 'bf16'?" in err, err


def test_info_shows_capabilities_only_for_backends_that_run_here(capsys):
    unavailable = [s.name for s in shardkit.backend_statuses() if not s.available]
    assert unavailable, "this machine should lack at least one built-in backend"
    status, short, _ = _cli(capsys, "info")
    assert status == 0
    blocks = short.split("\n\n")
    for name in unavailable:
        block = next(b for b in blocks if b.startswith(f"{name}: not available"))
        assert "HINT:" in block and "capabilities:" not in block, block
    assert f"(capabilities of {', '.join(unavailable)}: shardkit info --all)" in short
    status, full, _ = _cli(capsys, "info", "--all")
    assert status == 0 and full.count("capabilities:") == len(shardkit.backend_statuses())
    assert len(short.splitlines()) < len(full.splitlines())


def test_dir_of_shardkit_lists_the_public_names_only():
    names = dir(shardkit)
    assert names == sorted(shardkit.__all__)
    for private in ("Any", "TYPE_CHECKING", "annotations", "import_module"):
        assert private not in names


@pytest.mark.parametrize("world_size", [2, 3])
def test_global_mean_is_the_mean_over_ranks_on_every_rank(world_size):
    from tests._newcomer_workers import global_means

    results = shardkit.spawn(global_means, world_size, backend="cpu", threads_per_rank=1)
    expected = (world_size + 1) / 2
    for r in results:
        assert r["float"] == r["tensor"] == r["float32_1"] == expected, r
        assert r["launcher"] == "shardkit.spawn", r  # not "torchrun": spawn set torchrun's variables
        assert "takes one number per rank" in r["error"] and "global_mean(loss.mean())" in r["error"]


def test_read_extra_needs_no_model_and_names_a_missing_checkpoint(tmp_path):
    from tests._newcomer_workers import save_with_extra

    path = str(tmp_path / "ckpt")
    assert shardkit.spawn(save_with_extra, 2, path, backend="cpu", threads_per_rank=1) == [path] * 2
    extra = shardkit.checkpoint.read_extra(path)
    assert extra["epoch"] == 3 and extra["scheduler"]["last_epoch"] == 1
    assert extra["scheduler"]["_last_lr"] == [0.05]
    with pytest.raises(shardkit.CheckpointNotFoundError, match="nothing"):
        shardkit.checkpoint.read_extra(tmp_path / "nothing")


def _failure(rank: int, code: int, message: object = "", at: float = 0.0) -> types.SimpleNamespace:
    return types.SimpleNamespace(local_rank=rank, pid=100 + rank, exitcode=code, message=message,
                                 timestamp=at,
                                 signal_name=lambda: "SIGTERM" if code == -15 else "SIGKILL")


def test_a_failed_launch_is_summed_up_in_one_line_per_rank_root_cause_first():
    failures = {0: _failure(0, -15, at=5), 1: _failure(1, 1, {"message": "Traceback...\nValueError: bad"}, 3),
                2: _failure(2, 75, at=1), 3: _failure(3, 75, at=2)}
    assert describe_failures("train.py", failures).splitlines() == [
        "shardkit launch: train.py failed",
        "  rank 1 (local 1, pid 101) exited with status 1 (the root cause): ValueError: bad "
        "(its traceback is above)",
        "  rank 0 (local 0, pid 100) was stopped by torchrun (SIGTERM) after rank 1 failed",
        "  rank 2 (local 2, pid 102) exited with status 75: it stopped because a peer failed "
        "(its report is above)",
        "  rank 3 (local 3, pid 103) exited with status 75: it stopped because a peer failed "
        "(its report is above)"]


def test_a_killed_rank_is_the_root_cause_though_its_peers_reported_first():
    # A rank killed with SIGKILL writes no error file: torchrun times its failure when it
    # notices, after the survivors' reports of its death (their status 75) were written.
    failures = {0: _failure(0, 75, at=1), 1: _failure(1, -9, "Signal 9 (SIGKILL) received", 4),
                2: _failure(2, 75, at=2)}
    lines = describe_failures("t.py", failures).splitlines()
    assert lines[1] == "  rank 1 (local 1, pid 101) was killed by SIGKILL (the root cause)"
    assert lines[2].startswith("  rank 0 (local 0, pid 100) exited with status 75")


def test_pip_install_leaves_no_build_folder_to_shadow_the_build_package():
    # `python -m build` in a clone with a build/ folder runs the folder: "'build' is a package
    # and cannot be directly executed". setuptools' scratch space is named otherwise.
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    assert config["build"]["build_base"] not in ("build", "./build")
    assert config["build"]["build_base"] + "/" in (ROOT / ".gitignore").read_text()


def test_process_memory_never_reports_a_peak_below_the_current_value():
    from shardkit.backend import process_memory

    for _ in range(20):
        mem = process_memory()
        assert mem["peak"] >= mem["allocated"] > 0, mem


def test_the_demo_knows_when_fp16_would_run_on_the_host():
    from shardkit.demo.cli import _runs_on_host

    assert _runs_on_host("cpu") is True
    assert _runs_on_host("no-such-backend") is False  # the ranks report it, with the hint


def test_docs_install_lines_name_the_clone_not_an_index_that_lacks_shardkit():
    # shardkit is not on PyPI: `pip install 'shardkit[hf]'` fails for a reader who copies it.
    pages = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    for page in pages:
        text = page.read_text()
        for found in re.finditer(r"pip install ['\"]shardkit\[", text):
            assert "once shardkit is released" in text[found.start() - 100:found.start()].lower(), (
                page, text[found.start() - 100:found.end() + 20])


def test_an_interrupted_spawn_kills_every_rank_before_reaping_any():
    # Killed and reaped one by one, a rank still running saw its peer vanish and printed
    # "rank 0 died ..." after the user's Ctrl-C (1 in 18 Ctrl-Cs during the demo's training).
    from shardkit.job.spawn import _kill_all

    calls: list[str] = []

    class Proc:
        def __init__(self, name: str) -> None:
            self.name = name

        def kill(self) -> None:
            calls.append(f"kill {self.name}")

        def join(self) -> None:
            calls.append(f"join {self.name}")

    _kill_all([Proc("0"), Proc("1"), Proc("2")])
    assert calls == ["kill 0", "kill 1", "kill 2", "join 0", "join 1", "join 2"]
