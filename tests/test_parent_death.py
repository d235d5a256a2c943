"""Ranks end with the process that launched them (issue 26): SIGTERM or SIGKILL of the process
that called shardkit.spawn, or of `shardkit launch`, leaves no rank training as an orphan."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from shardkit.failure.node import pid_alive

ROOT = Path(__file__).resolve().parents[1]
# The ranks end within a watchdog tick of the signal; the slack is for a loaded 2-core machine.
GONE_WITHIN_S = 15

RANK_LOOP = textwrap.dedent("""
    import os, time, torch, shardkit

    def train(rank, pid_dir):
        model = shardkit.shard(torch.nn.Linear(4, 4))
        with open(os.path.join(pid_dir, f"rank{rank}"), "w") as f:
            f.write(str(os.getpid()))
        while True:  # an orphan would go on stepping for ever
            model(torch.ones(2, 4)).sum().backward()
            time.sleep(0.05)
    """)

SPAWNING = RANK_LOOP + textwrap.dedent("""
    if __name__ == "__main__":
        import sys
        shardkit.spawn(train, 2, sys.argv[1], backend="cpu", threads_per_rank=1)
    """)

# A rank killed with its launcher while it still loads (before shardkit.init()): the pid file
# is written before `import shardkit`, so the launcher may die before the import or after it.
LOADING = textwrap.dedent("""
    import os, sys, time
    with open(os.path.join(sys.argv[1], "rank" + os.environ["LOCAL_RANK"]), "w") as f:
        f.write(str(os.getpid()))
    import shardkit, torch
    time.sleep(600)  # loading a dataset for ever: only the launcher's death can end this
    shardkit.init()
    """)

LAUNCHED = RANK_LOOP + textwrap.dedent("""
    if __name__ == "__main__":
        import sys
        shardkit.init()
        train(shardkit.init().rank, sys.argv[1])
    """)


def _rank_pids(pid_dir: Path, bound: float) -> list[int]:
    deadline = time.time() + bound
    while len(list(pid_dir.glob("rank*"))) < 2 or any(
            not p.read_text() for p in pid_dir.glob("rank*")):
        assert time.time() < deadline, "the ranks never started"
        time.sleep(0.2)
    return [int((pid_dir / f"rank{r}").read_text()) for r in range(2)]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHELASTIC", "SHARDKIT_", "MASTER_", "RANK", "WORLD_SIZE",
                                "LOCAL_RANK"))}
    # Without the watchdog, so only the parent-death path can end the ranks (under torchrun the
    # watchdog would also notice the agent's store go, a few seconds later).
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", SHARDKIT_WATCHDOG="0")
    return env


# Spawn's ranks watch the caller's pid (either signal); `shardkit launch`'s ask the kernel for a
# signal when it dies (SIGKILL is the case torchrun cannot handle; SIGTERM it forwards itself).
@pytest.mark.slow
@pytest.mark.parametrize("how,sig", [pytest.param("spawn", signal.SIGTERM, marks=pytest.mark.long),
                                     ("spawn", signal.SIGKILL),
                                     pytest.param("launch", signal.SIGKILL,
                                                  marks=pytest.mark.long),
                                     ("launch-before-init", signal.SIGKILL)],
                         ids=["spawn-SIGTERM", "spawn-SIGKILL", "launch-SIGKILL",
                              "launch-SIGKILL-before-init"])
def test_ranks_end_when_their_launching_process_is_signalled(tmp_path, how, sig):
    script = tmp_path / "train.py"
    script.write_text({"spawn": SPAWNING, "launch": LAUNCHED, "launch-before-init": LOADING}[how])
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    command = ([sys.executable, str(script), str(pid_dir)] if how == "spawn" else
               [sys.executable, "-m", "shardkit.cli.main", "launch", "--backend", "cpu",
                "--nproc", "2", str(script), str(pid_dir)])
    with open(tmp_path / "out.log", "w") as out:
        parent = subprocess.Popen(command, env=_env(), cwd=ROOT, stdout=out,
                                  stderr=subprocess.STDOUT)
    try:
        ranks = _rank_pids(pid_dir, 120)
        time.sleep(0.0 if how == "launch-before-init" else 1.0)
        parent.send_signal(sig)
        parent.wait(timeout=60)
        signalled = time.time()
        while any(pid_alive(p) for p in ranks) and time.time() - signalled < GONE_WITHIN_S:
            time.sleep(0.1)
        alive = [p for p in ranks if pid_alive(p)]
        assert not alive, f"ranks {alive} still running {GONE_WITHIN_S} s after {sig.name}"
    finally:
        parent.kill()
        for p in _rank_pids(pid_dir, 0) if len(list(pid_dir.glob("rank*"))) == 2 else []:
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)
