"""Fault tolerance across replica groups: shardkit + torchft vs torch FSDP2 + torchft vs plain HYBRID.

Simulated nodes (network namespaces, root): the torchft lighthouse on its own node, each replica
group (2 ranks) on its own node. Two measurements, each engine in the same run:

1. s/step with nothing failing (median over the steps after warm-up): shardkit HYBRID_SHARD with
   fault_tolerance=, torch's fully_shard per group + torchft (torchtitan's recipe: FSDP2's
   all-reduce hook runs the Manager's all-reduce, torchft's OptimizerWrapper), and shardkit
   HYBRID_SHARD as one job over every group (no torchft: the cost of being fault tolerant).
2. every rank of one group SIGKILLed mid-step (between forward and backward) and restarted by its
   torchrun: the survivors' stall (their slowest step around the kill minus their median step),
   the step attempts they lost, and the time from the kill to the restarted group's first
   committed step (relaunch: a new process is up; rejoin: it trained a step with the others).

    sudo python benchmarks/bench_fault_tolerance.py --groups 3 --width 512 --steps 60

Prints one JSON object; benchmarks/README.md keeps the figures.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
import simcluster  # noqa: E402
from _ft_harness import FTJob, outage  # noqa: E402


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=HERE).stdout.strip()
    except OSError:
        return "?"


def step_times(job: FTJob, groups: int, skip: int) -> float:
    """Median s/step over every group's committed steps after the first `skip`."""
    times = [r["t1"] - r["t0"] for g in range(groups) for r in job.steps_of(g)
             if r["step"] >= skip and r["committed"]]
    return statistics.median(times)


def run(engine: str, groups: int, steps: int, width: int, out: Path, kill_at: int | None) -> dict:
    """One job of `engine` on fresh simulated nodes; its timing (and outage, with kill_at)."""
    with simcluster.SimCluster(groups + 1, hostnames=True) as cluster:
        job = FTJob(cluster, groups, steps, out, engine=engine,
                    worker_args=("--width", str(width)))
        extra = {groups - 1: ("--kill-at", str(kill_at))} if kill_at is not None else {}
        if engine == "plain":
            job.start_plain()
        else:
            job.start(extra)
        codes = job.wait(600)
        if any(codes.values()):
            raise SystemExit(f"{engine}: a group failed\n{job.tails()}")
    result = {"s_per_step": round(step_times(job, groups, skip=5), 4)}
    if kill_at is not None:
        result.update(outage(job, list(range(groups - 1)), [groups - 1]))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=3)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kill-at", type=int, default=20)
    args = ap.parse_args()
    why = simcluster.unavailable_reason()
    if why:
        raise SystemExit(f"needs network namespaces: {why}")
    report: dict = {"machine": platform.node(), "cpus": len(__import__("os").sched_getaffinity(0)),
                    "torch": torch.__version__, "commit": _commit(), "groups": args.groups,
                    "ranks_per_group": 2, "width": args.width, "steps": args.steps}
    with tempfile.TemporaryDirectory() as tmp:
        for engine in ("shardkit", "fsdp2", "plain"):
            report[f"{engine}_no_failure"] = run(engine, args.groups, args.steps, args.width,
                                                 Path(tmp) / f"{engine}-clean", None)
        for engine in ("shardkit", "fsdp2"):
            report[f"{engine}_kill"] = run(engine, args.groups, args.steps, args.width,
                                           Path(tmp) / f"{engine}-kill", args.kill_at)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
