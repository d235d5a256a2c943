"""The safety net never hurts a healthy job: no live peer declared dead where /proc is missing
or hostnames repeat, an off switch, nothing process-wide left behind, and no interpreter ended
when it is a notebook or REPL (issue 25's items 2 and 4)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import shardkit
from shardkit.failure import node, watchdog_requested
from shardkit.failure import watchdog
from shardkit.failure.watchdog import Failure, Watchdog
from shardkit.job.spawn import free_port

from _failure_workers import watchdog_state

ROOT = Path(__file__).resolve().parents[1]


def _exited_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_without_proc_a_live_pid_is_alive_and_an_exited_one_is_not(monkeypatch, tmp_path):
    monkeypatch.setattr(node, "PROC", str(tmp_path))  # a /proc with nothing in it (macOS)
    assert node.pid_alive(os.getpid())
    assert not node.pid_alive(_exited_pid())
    assert node.node_identity() is None  # nothing to tell machines apart: no peer is local


def test_with_proc_pids_are_checked_and_the_node_names_boot_and_pid_namespace():
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc here")
    assert node.pid_alive(os.getpid()) and not node.pid_alive(_exited_pid())
    ident = node.node_identity()
    assert ident is not None and ident.count("/") >= 2


def _watchdog(store, me_node: str | None, monkeypatch) -> Watchdog:
    monkeypatch.setattr("shardkit.failure.watchdog.node_identity", lambda: me_node)
    # As the store's host, finish() waits for rank 1 to shut down: it is said to have done so
    # already (a large negative heartbeat), so each test ends at once instead of after 10 s.
    store.add("shardkit/failure/hb/1", -(1 << 40))
    return Watchdog(store, 0, 2, timeout=3600.0)


@pytest.mark.parametrize("peer_node, local", [
    ("hostA/boot-1/4026531836", True),    # the same machine and pid namespace: check its pid
    ("hostA/boot-2/4026531836", False),   # same hostname, another machine (another boot)
    ("hostA/boot-1/4026532999", False),   # same machine, another container (pid namespace)
])
def test_only_peers_of_the_same_node_are_checked_by_pid(monkeypatch, peer_node, local):
    store = dist.HashStore()
    wd = _watchdog(store, "hostA/boot-1/4026531836", monkeypatch)
    try:
        store.set("shardkit/failure/pid/1", f"{peer_node}:{_exited_pid()}")
        assert wd._dead_local_peers() == ([1] if local else [])
    finally:
        wd.finish()


def test_a_report_names_the_host_of_a_peer_on_another_machine(monkeypatch):
    # A SLURM node that went down: the survivors' report must say which machine to look at.
    store = dist.HashStore()
    wd = _watchdog(store, "hostA/boot-1/4026531836", monkeypatch)
    try:
        store.set("shardkit/failure/pid/1", f"gpu-node-17/boot-9/4026531836:{_exited_pid()}")
        wd._dead_local_peers()  # the first tick reads every peer's pid and host once
        failure = Failure(1, "stopped responding (no heartbeat for 31.0 s, timeout 30 s)")
        message = wd.survivor_message([failure])
        assert message.startswith("shardkit: rank 1 (on gpu-node-17) stopped responding (no "
                                  "heartbeat for 31.0 s"), message
        # Not "the failed rank's own error is the cause": a silent rank raised nothing.
        assert "HINT: a rank stops responding when its process hangs" in message
        assert "its machine went down or lost its network" in message
        # A peer on this rank's own host is named by rank alone, as before.
        wd._peer_hosts[1] = wd.host
        assert wd.survivor_message([failure]).startswith("shardkit: rank 1 stopped responding")
    finally:
        wd.finish()


def test_a_rank_ended_by_sigterm_is_reported_as_stopped_from_outside_never_as_the_cause(
        monkeypatch):
    # A scheduler's SIGTERM to every rank: a rank whose handler ran after a peer's had exited
    # said "a launcher does this to every rank once one failed: rank 0 died" (2 runs in 12 of
    # test_sigterm_from_outside_is_one_line_per_process_and_exit_143 beside a busy core).
    store = dist.HashStore()
    wd = _watchdog(store, "hostA/boot-1/4026531836", monkeypatch)
    try:
        stopped = Failure(1, watchdog.TERMINATED, posted=True)
        alone = wd.survivor_message([stopped])
        assert alone.startswith("shardkit: rank 1 was terminated by SIGTERM (from its launcher "
                                "or a scheduler"), alone
        assert "HINT: nothing failed in training: the job was stopped from outside" in alone
        # Beside a real failure, the terminated rank is left out of the story.
        raised = Failure(2, "raised ValueError: bad batch (in unit 'blocks.0', forward)", posted=True)
        both = wd.survivor_message([stopped, raised])
        assert both.startswith("shardkit: rank 2 raised ValueError") and "rank 1" not in both, both
        # A rank whose launcher ended (the kernel's parent-death SIGTERM) points at the launcher.
        orphan = wd.survivor_message([Failure(1, watchdog.ORPHANED, posted=True)])
        assert "rank 1 was terminated by SIGTERM (the process that launched it ended)" in orphan
        assert "HINT: a rank's launcher ended" in orphan, orphan
        # What a peer reads once a rank posted it: a posted failure, so never "died".
        peer = Watchdog.__new__(Watchdog)
        peer.store, peer.peers = store, [0]
        for orphaned, cause in ((False, watchdog.TERMINATED), (True, watchdog.ORPHANED)):
            wd.mark_terminated(orphaned)
            assert [(f.rank, f.cause, f.stopped) for f in peer.posted()] == [(0, cause, True)]
        # A survivor that reported leaves what it saw for the rank its launcher stops next: on a
        # SLURM node failure that rank saw no failure yet (the lost node's ranks were still
        # within their heartbeat timeout) and said "stopped from outside".
        assert wd.reported_by_a_peer() == ""
        wd.acknowledge([stopped, raised])
        assert wd.reported_by_a_peer() == (
            "rank 2 raised ValueError: bad batch (in unit 'blocks.0', forward)")
    finally:
        wd.finish()


def test_a_peer_that_shuts_down_between_the_heartbeat_read_and_the_pid_check_is_not_dead(
        monkeypatch):
    # The default lane's test_torch_gradient_clipping_sees_the_whole_model[clip_grad_norm_-3]
    # failed once so: ranks 1 and 2 returned, shut down and exited 0 while rank 0 was still
    # computing its results, and rank 0's watchdog reported "rank 1 died". A tick read the
    # heartbeats (rank 1 still running), rank 1 marked itself done and exited, then the tick's
    # pid check found it gone. Here the pid check itself stands for that moment.
    store = dist.HashStore()
    here = "hostA/boot-1/4026531836"
    wd = _watchdog(store, here, monkeypatch)
    try:
        store.add("shardkit/failure/hb/1", 1 << 40)  # running again: not yet shut down
        store.set("shardkit/failure/pid/1", f"{here}:{_exited_pid()}")
        wd.check()  # the heartbeats read, as on every tick

        calls = []

        def finished_in_between(pid: int) -> bool:
            calls.append(pid)
            if len(calls) == 1:
                return True  # the tick's first look, before it reads the heartbeats: alive
            if len(calls) == 2:  # its second look, after: shutdown() marked it done, it exited
                store.add("shardkit/failure/hb/1", -(1 << 40))
            return False

        monkeypatch.setattr("shardkit.failure.watchdog.pid_alive", finished_in_between)
        assert wd.check() == []
        assert len(calls) >= 2  # the window was opened
        # A process gone without shutting down is still reported.
        store.add("shardkit/failure/hb/1", 7 - store.add("shardkit/failure/hb/1", 0))
        monkeypatch.setattr("shardkit.failure.watchdog.pid_alive", lambda pid: False)
        wd._done.clear()
        assert [f.rank for f in wd.check()] == [1]
    finally:
        wd.finish()


def test_a_node_that_cannot_name_itself_checks_no_pid(monkeypatch):
    store = dist.HashStore()
    wd = _watchdog(store, None, monkeypatch)
    try:
        store.set("shardkit/failure/pid/1", f"-:{_exited_pid()}")  # a peer that cannot either
        assert wd._dead_local_peers() == []
    finally:
        wd.finish()


def test_watchdog_switch_argument_then_environment(monkeypatch):
    monkeypatch.delenv("SHARDKIT_WATCHDOG", raising=False)
    assert watchdog_requested(None) and not watchdog_requested(False)
    for off in ("0", "false", "off"):
        monkeypatch.setenv("SHARDKIT_WATCHDOG", off)
        assert not watchdog_requested(None) and watchdog_requested(True)
    with pytest.raises(shardkit.ShardkitError, match="watchdog must be"):
        watchdog_requested("no")


@pytest.mark.slow
@pytest.mark.parametrize("env, active", [(None, True), ("0", False)])
def test_spawned_ranks_start_the_watchdog_unless_switched_off_and_restore_the_hook(
        monkeypatch, env, active):
    if env is None:
        monkeypatch.delenv("SHARDKIT_WATCHDOG", raising=False)
    else:
        monkeypatch.setenv("SHARDKIT_WATCHDOG", env)
    for r in shardkit.spawn(watchdog_state, 2, threads_per_rank=1):
        assert r["active"] is active and r["hook_replaced"] is active
        assert r["hook_restored"]


_NOTEBOOK_RANK = textwrap.dedent("""
    import os, signal, sys
    if os.environ["RANK"] == "0":
        sys.ps1 = ">>> "  # what a REPL or notebook kernel has
    import torch, torch.nn.functional as F, shardkit
    sys.path.insert(0, {tests!r})
    from _models import Block, TinyNet, batch
    shardkit.init(timeout=10)
    torch.manual_seed(0)
    model = shardkit.shard(TinyNet(), auto_wrap_policy=shardkit.wrap.transformer_layers({{Block}}))
    caught = "nothing"
    try:
        for step in range(1000):
            if os.environ["RANK"] == "1" and step == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = batch(step, int(os.environ["RANK"]))
            F.cross_entropy(model(x), y).backward()
    except Exception as exc:  # what the user sees in the cell
        caught = type(exc).__name__
    import time
    time.sleep(3)  # the session goes on: the watchdog has long seen rank 1's death by now
    print("alive after", caught, flush=True)
""")


@pytest.mark.slow
@pytest.mark.long
def test_an_interactive_rank_gets_an_exception_instead_of_being_ended(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(_NOTEBOOK_RANK.format(tests=str(ROOT / "tests")))
    env = {**os.environ, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(script)], cwd=tmp_path,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    started = time.monotonic()
    out, err = procs[0].communicate(timeout=120)
    procs[1].wait(timeout=30)
    assert procs[1].returncode == -9
    assert procs[0].returncode == 0, err  # not PEER_FAILED_EXIT (75): the kernel lives on
    assert "alive after" in out and "alive after nothing" not in out, (out, err)
    assert "rank 1 died" in err  # the watchdog still named the culprit
    assert time.monotonic() - started < 60


def test_where_follows_the_forward_out_of_each_unit_and_past_the_model():
    from shardkit.failure import where

    from _models import Block, TinyNet

    shardkit.init(backend="cpu")
    try:
        assert where.describe() == "setup, before any sharded unit ran"
        torch.manual_seed(0)
        model = shardkit.shard(TinyNet(), auto_wrap_policy=shardkit.wrap.transformer_layers({Block}))
        seen = []
        model.blocks[0].register_forward_hook(lambda *a: seen.append(where.describe()))
        model.blocks[1].register_forward_pre_hook(lambda *a: seen.append(where.describe()))
        out = model(torch.randn(2, 1, 4, 4))
        # Block 0 finished: the rank is back in the root unit (not "still in blocks.0"), then in
        # blocks.1, and past the model once forward returned (a failing loss is located there).
        assert seen == ["unit '<root>', forward", "unit 'blocks.1', forward"]
        assert where.describe() == ("after the model's forward (the loss, or your code before "
                                    "backward)")
        out.sum().backward()
        assert where.describe().endswith(", backward")
    finally:
        shardkit.shutdown()


_REPORTED_PEER_FAILURE = textwrap.dedent("""
    import atexit, sys
    from shardkit import failure
    from shardkit.errors import PeerFailedError
    # What start() installs in a launched rank, then what shutdown() does on the way out.
    failure._previous_excepthook, sys.excepthook = sys.excepthook, failure._excepthook
    atexit.register(lambda: open({flushed!r}, "w").write("user's atexit ran"))
    err = PeerFailedError("shardkit: rank 1 stopped responding (report printed already)")
    err.reported = {reported}
    failure.stop(leaving_with=err)
    print("hook kept:", sys.excepthook is failure._excepthook, flush=True)
    raise err
""")


@pytest.mark.parametrize("reported", [True, False])
def test_a_reported_peer_failure_leaving_the_script_ends_the_rank_as_a_survivor(tmp_path, reported):
    # The rank's own exception path (through `finally: shardkit.shutdown()`) can report a peer's
    # failure before the watchdog thread does; the rank must then end as the thread would end it
    # (status 75, nothing printed after the report), not with a second copy as a traceback and
    # status 1, which made the exit status depend on which path won the race.
    flushed = tmp_path / "atexit"
    proc = subprocess.run([sys.executable, "-c", _REPORTED_PEER_FAILURE.format(
        flushed=str(flushed), reported=reported)], capture_output=True, text=True, timeout=120,
        cwd=ROOT)
    if reported:
        assert proc.returncode == 75, proc.stderr
        assert proc.stdout == "hook kept: True\n" and proc.stderr == "", proc.stderr
        assert flushed.read_text() == "user's atexit ran"
    else:  # not printed yet: an ordinary uncaught exception, the hook put back
        assert proc.returncode == 1
        assert proc.stdout == "hook kept: False\n"
        assert proc.stderr.rstrip().endswith("stopped responding (report printed already)")
