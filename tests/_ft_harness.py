"""Run a fault-tolerant job on simulated nodes: the lighthouse on node 0, replica group g on node g+1.

Each group is its own torchrun (2 ranks, `--max-restarts 1`: a group whose ranks die is restarted
by its launcher, as a cluster's would), started inside its node's namespace with the node's own
host name (SimCluster(hostnames=True)), so torchft's servers advertise addresses the other nodes
reach. Shared by tests/test_fault_tolerance.py and benchmarks/bench_fault_tolerance.py.

`replay` is the independent reference: one process, the unsharded model, plain AdamW, replaying
every committed step with exactly the replica groups whose gradients that step averaged.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _ft_model import batch, build_model  # noqa: E402

LIGHTHOUSE_PORT = 29510
RANKS_PER_GROUP = 2


def lighthouse_binary() -> str:
    """torchft's lighthouse, next to this Python."""
    return str(Path(sys.executable).with_name("torchft_lighthouse"))


class FTJob:
    """A lighthouse and `groups` replica groups on `cluster` (a SimCluster with groups + 1 nodes)."""

    def __init__(self, cluster: Any, groups: int, steps: int, out: Path, engine: str = "shardkit",
                 worker_args: tuple[str, ...] = (), heartbeat_ms: int = 2000,
                 join_ms: int = 1000, min_replicas: int = 1) -> None:
        self.cluster, self.groups, self.steps, self.out = cluster, groups, steps, out
        self.engine, self.worker_args = engine, worker_args
        self.heartbeat_ms, self.join_ms, self.min_replicas = heartbeat_ms, join_ms, min_replicas
        self.lighthouse: subprocess.Popen | None = None
        self.launchers: dict[int, subprocess.Popen] = {}
        out.mkdir(parents=True, exist_ok=True)

    @property
    def lighthouse_address(self) -> str:
        """What the groups are told: node 0's address."""
        return f"http://{self.cluster.address(0)}:{LIGHTHOUSE_PORT}"

    def start_lighthouse(self) -> None:
        """torchft's lighthouse in its own process on node 0."""
        log = open(self.out / "lighthouse.log", "ab")
        self.lighthouse = self.cluster.start(0, [
            lighthouse_binary(), "--min_replicas", str(self.min_replicas),
            "--bind", f"{self.cluster.address(0)}:{LIGHTHOUSE_PORT}",
            "--heartbeat_timeout_ms", str(self.heartbeat_ms),
            "--join_timeout_ms", str(self.join_ms), "--quorum_tick_ms", "50"],
            stdout=log, stderr=subprocess.STDOUT)

    def start_group(self, group: int, *extra: str, max_restarts: int = 1) -> subprocess.Popen:
        """Group `group`'s torchrun on node group+1."""
        node = group + 1
        env = {**os.environ, "TORCHFT_LIGHTHOUSE": self.lighthouse_address,
               "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "RUST_LOG": "warn"}
        log = open(self.out / f"launcher{group}.log", "ab")
        proc = self.cluster.start(node, [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
            "--nproc-per-node", str(RANKS_PER_GROUP), "--max-restarts", str(max_restarts),
            "--master-addr", self.cluster.address(node), "--master-port", "29500",
            str(HERE / "_ft_worker.py"), "--group", str(group), "--steps", str(self.steps),
            "--out", str(self.out), "--engine", self.engine, *self.worker_args, *extra],
            env=env, stdout=log, stderr=subprocess.STDOUT)
        self.launchers[group] = proc
        return proc

    def start_plain(self) -> None:
        """No torchft: one shardkit HYBRID_SHARD job over every group's node (group g = node g+1)."""
        for group in range(self.groups):
            node = group + 1
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
            log = open(self.out / f"launcher{group}.log", "ab")
            self.launchers[group] = self.cluster.start(node, [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", str(self.groups),
                "--node-rank", str(group), "--nproc-per-node", str(RANKS_PER_GROUP),
                "--master-addr", self.cluster.address(1), "--master-port", "29500",
                str(HERE / "_ft_worker.py"), "--group", str(group), "--steps", str(self.steps),
                "--out", str(self.out), "--engine", "plain", *self.worker_args],
                env=env, stdout=log, stderr=subprocess.STDOUT)

    def start(self, extra: dict[int, tuple[str, ...]] | None = None) -> None:
        """The lighthouse, then every group."""
        self.start_lighthouse()
        time.sleep(0.5)
        for group in range(self.groups):
            self.start_group(group, *(extra or {}).get(group, ()))

    def wait(self, timeout: float) -> dict[int, int]:
        """Every launcher's exit code (raises with the logs' tails past `timeout`)."""
        deadline = time.time() + timeout
        codes = {}
        for group, proc in self.launchers.items():
            try:
                codes[group] = proc.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"group {group} still running after {timeout} s\n"
                                     + self.tails()) from None
        return codes

    def tails(self, lines: int = 25) -> str:
        """The last lines of every log, for a failure message."""
        parts = []
        for path in sorted(self.out.glob("*.log")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"== {path.name}\n" + "\n".join(text))
        return "\n".join(parts)

    def worker_pids(self, group: int) -> list[int]:
        """The pids of group `group`'s live ranks (from their start lines, newest incarnation)."""
        pids = []
        for rank in range(RANKS_PER_GROUP):
            starts = [r for r in self.records(group, rank) if r.get("event") == "start"]
            if starts:
                pids.append(starts[-1]["pid"])
        return pids

    def records(self, group: int, rank: int = 0) -> list[dict]:
        """Every JSON line rank `rank` of group `group` wrote, in order."""
        path = self.out / f"group{group}_rank{rank}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def steps_of(self, group: int) -> list[dict]:
        """Group `group`'s step records (rank 0)."""
        return [r for r in self.records(group) if "committed" in r]

    def final_weights(self, group: int) -> dict[str, torch.Tensor]:
        """The full weights group `group` ended with."""
        return torch.load(self.out / f"final_group{group}.pt")


def participants_by_step(job: FTJob, steps: int) -> list[list[int]]:
    """For each step, the groups whose gradients its committed update averaged.

    A committed record names its quorum; the groups that took part are those with a
    participating record of the same step in the same quorum (a group still healing is in the
    quorum but contributes nothing, and is not counted).
    """
    records = {g: job.steps_of(g) for g in range(job.groups)}
    out = []
    for step in range(steps):
        quorums = {r["quorum"] for recs in records.values() for r in recs
                   if r["step"] == step and r["committed"] and r["participating"]}
        # Two quorums for one step: groups relaunched after every other group had finished
        # (or died) formed one of their own at step 0 and trained from their initial weights
        # (issue 57; shardkit warns in such a group: "trains from its initial weights").
        assert len(quorums) == 1, f"step {step} committed in quorums {quorums}"
        quorum = quorums.pop()
        out.append(sorted(g for g, recs in records.items()
                          if any(r["step"] == step and r["participating"] and r["quorum"] == quorum
                                 for r in recs)))
    return out


def replay(participants: list[list[int]], width: int) -> dict[str, torch.Tensor]:
    """The unsharded model trained in one process on exactly the committed steps' batches."""
    torch.manual_seed(0)
    model = build_model(width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step, groups in enumerate(participants):
        xs, ys = zip(*[batch(step, g, r, width) for g in groups for r in range(RANKS_PER_GROUP)])
        opt.zero_grad()
        F.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def outage(job: FTJob, survivors: list[int], killed: list[int]) -> dict:
    """Stall (s), step attempts the survivors lost, and each killed group's time to rejoin (s)."""
    kill_t = min(r["t"] for g in killed for r in job.records(g) if r.get("event") == "kill")
    times = [r["t1"] - r["t0"] for g in survivors for r in job.steps_of(g)]
    typical = sorted(times)[len(times) // 2]
    around = [r["t1"] - r["t0"] for g in survivors for r in job.steps_of(g)
              if r["t1"] >= kill_t and r["t0"] <= kill_t + 10]
    lost = sum(not r["committed"] for g in survivors for r in job.steps_of(g))
    rejoin = {}
    for g in killed:
        restarts = [r for r in job.records(g) if r.get("event") == "start"]
        assert len(restarts) == 2, f"group {g} was not restarted exactly once"
        back = [r for r in job.steps_of(g) if r["t0"] > restarts[1]["t"] and r["participating"]
                and r["committed"]]
        assert back, f"group {g} never took part again after its restart"
        rejoin[g] = {"relaunch_s": restarts[1]["t"] - kill_t,
                     "rejoin_s": back[0]["t1"] - kill_t}
    return {"stall_s": max(around) - typical, "typical_step_s": typical,
            "lost_attempts": lost / len(survivors), "rejoin": rejoin}


def stop(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Signal a started process's whole session."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
