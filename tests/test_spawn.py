"""`shardkit.spawn` start methods: ranks see the caller's environment and output as they are at each call."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import shardkit

MARK = "SHARDKIT_TEST_SPAWN_MARK"


def report(rank: int, say: bool = True) -> dict:
    """What a rank sees: the marker variable, its thread count, and its process group size."""
    if say:  # one write per line: print() writes the newline separately, so ranks could interleave
        for stream, name in ((sys.stdout, "stdout"), (sys.stderr, "stderr")):
            stream.write(f"rank {rank} to {name}\n")
            stream.flush()
    return {"rank": rank, "mark": os.environ.get(MARK), "threads": torch.get_num_threads(),
            "world": shardkit.current_context().world_size, "pid": os.getpid()}


@pytest.mark.slow
def test_forkserver_ranks_get_the_environment_and_output_of_each_call(monkeypatch, capfd):
    monkeypatch.delenv(MARK, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    with capfd.disabled():  # a server this starts keeps the terminal as its stdout and stderr
        first = shardkit.spawn(report, 2, False, backend="cpu", start_method="forkserver")
    # The server is running now, started with the environment above; the next call changes it
    # and captures the output.
    monkeypatch.setenv(MARK, "set after the server started")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    second = shardkit.spawn(report, 2, backend="cpu", start_method="forkserver")
    out, err = capfd.readouterr()
    assert sorted(out.splitlines()) == ["rank 0 to stdout", "rank 1 to stdout"], (out, err)
    assert sorted(err.splitlines()) == ["rank 0 to stderr", "rank 1 to stderr"], (out, err)
    assert [(r["rank"], r["mark"], r["threads"], r["world"]) for r in first] == [
        (0, None, 2, 2), (1, None, 2, 2)]
    assert [(r["rank"], r["mark"], r["threads"], r["world"]) for r in second] == [
        (0, "set after the server started", 1, 2), (1, "set after the server started", 1, 2)]
    assert len({r["pid"] for r in first + second} | {os.getpid()}) == 5


@pytest.mark.slow
def test_spawn_start_method_runs_fresh_interpreters_the_same_way(monkeypatch):
    monkeypatch.setenv(MARK, "spawned")
    out = shardkit.spawn(report, 2, backend="cpu", threads_per_rank=1, start_method="spawn")
    assert [(r["rank"], r["mark"], r["threads"], r["world"]) for r in out] == [
        (0, "spawned", 1, 2), (1, "spawned", 1, 2)]


def test_unknown_start_method_says_which_exist():
    with pytest.raises(shardkit.ShardkitError,
                       match=r"start_method must be one of forkserver, spawn on this platform, "
                             r"got 'fork'"):
        shardkit.spawn(report, 2, backend="cpu", start_method="fork")
