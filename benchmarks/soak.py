"""Run multi-rank scenarios again and again beside a CPU hog, and count the runs that fail (issue 55).

Scripts run as users run them; the scenarios whose pass is more than an exit status (a rank
killed, a Ctrl-C, a second job, two simulated nodes, a group of a fault-tolerant job killed, a
SLURM node failure) run the long-lane test that already holds their outcome.

    python benchmarks/soak.py --runs 50 --hog 2                  # every scenario, 50 runs each
    python benchmarks/soak.py --only torch-ddp-exit lightning-ddp --runs 200 --keep /tmp/soak

A run fails when any of its processes exits non-zero, prints "terminate called", or times out.
Each run has its own folder (the processes' working directory) with core dumps enabled there; the
first failing run of each scenario is kept with its log and, where a core was written and gdb is
installed, every thread's backtrace (`backtrace.txt`): what issue 55 asks of the exit abort (which
object's C++ thread was still joinable). Passing runs' folders are removed.

The hog is N busy processes (default: one per core), so a 2-core machine runs the ranks loaded,
as CI's parallel work and a shared machine do. Wall-clock times are printed for sizing timeouts
(worst case under load), never as a speed figure.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# torch alone, no shardkit in the process: the reference for "is the exit abort torch's own".
TORCH_DDP_EXIT = '''
import torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
model = torch.nn.parallel.DistributedDataParallel(net)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
for _ in range(8):
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step()
    opt.zero_grad()
dist.barrier()  # and no destroy_process_group(), as Lightning's Trainer leaves it
'''

# A script whose last line starts a background save and returns; the checkpoint is then loaded
# at 2 ranks in a fresh job, with its optimizer, and must hold what was saved (issue 55: once
# refused by a fresh process, "does not match the model", then accepted).
BACKGROUND_SAVE = '''
import json, torch, shardkit, shardkit.checkpoint as ckpt
ctx = shardkit.init()
torch.manual_seed(0)
model = shardkit.shard(torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)]),
                       auto_wrap_policy=lambda m: isinstance(m, torch.nn.Linear))
opt = torch.optim.AdamW(model.parameters())
for _ in range(3):
    model(torch.ones(4, 32)).sum().backward()
    opt.step()
    opt.zero_grad()
full = ckpt.full_state_dict(model)
if ctx.rank == 0:
    with open("expected.json", "w") as f:
        json.dump({k: v.double().sum().item() for k, v in full.items()}, f)
ckpt.save("ckpt", model, opt, extra={"step": 3}, background=True)
'''
RELOAD = '''
import json, torch, shardkit, shardkit.checkpoint as ckpt
ctx = shardkit.init()
model = shardkit.shard(torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)]),
                       auto_wrap_policy=lambda m: isinstance(m, torch.nn.Linear))
opt = torch.optim.AdamW(model.parameters())
assert ckpt.load("ckpt", model, opt) == {"step": 3}
full = ckpt.full_state_dict(model)
if ctx.rank == 0:
    with open("expected.json") as f:
        expected = json.load(f)
    got = {k: v.double().sum().item() for k, v in full.items()}
    assert got == expected, (got, expected)
    print("reloaded what was saved")
'''


@dataclass(frozen=True)
class Scenario:
    """One multi-rank job: the commands run one after another in a fresh folder."""

    name: str
    commands: tuple[tuple[str, ...], ...]
    timeout_s: float = 300.0
    files: tuple[tuple[str, str], ...] = ()  # (name, text) written into the folder first


def _py(*args: str) -> tuple[str, ...]:
    return (sys.executable, *args)


def _test(*node_ids: str) -> tuple[str, ...]:
    """The long-lane tests that already drive a scenario and hold its outcome, by node id: a kill,
    a Ctrl-C or a second job is expected to end some processes, so their test says what passes."""
    return _py("-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "long or not long",
               "--rootdir", str(ROOT), *(str(ROOT / "tests" / node) for node in node_ids))


# Scenarios whose pass is more than an exit status, each run through the long-lane test that
# holds its outcome: {name: (test node id under tests/, seconds allowed)}.
TEST_SCENARIOS = {
    "elastic-restart-killed": ("test_elastic_restart.py::test_a_killed_rank_restarts_and_resumes_"
                               "to_the_uninterrupted_weights", 600),
    "kill-a-rank": ("test_failure_rank_dies.py::test_shardkit_launch_exits_non_zero_with_the_"
                    "culprit", 600),
    "two-jobs-one-machine": ("test_two_jobs.py::test_two_spawns_and_two_launches_run_side_by_side",
                             600),
    "ctrl-c-demo": ("test_cli_startup.py::test_ctrl_c_ends_the_demo_quietly_with_130", 600),
    "sigterm-from-outside": ("test_cli_startup.py::test_sigterm_from_outside_is_one_line_per_"
                             "process_and_exit_143", 600),
    "planner-measure": ("test_planner_measure.py::test_measure_trains_the_plan_and_the_plan_holds",
                        600),
    "two-node-hybrid": ("test_multinode.py::test_two_nodes_train_like_one_process_and_count_inter_"
                        "node_bytes_as_planned", 900),
    "ft-hybrid-group-killed": ("test_fault_tolerance.py::test_a_killed_group_restarts_and_rejoins_"
                               "while_the_others_train_on", 900),
    "slurm-node-failure": ("test_slurm.py::test_a_node_that_fails_requeues_the_docs_job_which_"
                           "resumes_to_the_same_weights", 900),
}

SCENARIOS = {s.name: s for s in (
    Scenario("torch-ddp-exit", (_py("-m", "torch.distributed.run", "--nproc-per-node", "2",
                                    "script.py"),), files=(("script.py", TORCH_DDP_EXIT),)),
    Scenario("quickstart", (_py("-m", "shardkit", "launch", "--nproc", "2",
                                str(ROOT / "examples" / "quickstart.py")),)),
    Scenario("fsdp2-reference", (_py("-m", "torch.distributed.run", "--nproc-per-node", "2",
                                     str(ROOT / "examples" / "from_fsdp2" / "fsdp2_train.py"), "."),)),
    Scenario("lightning-ddp", (_py(str(ROOT / "tests" / "_lightning_script.py"), "--strategy", "ddp",
                                   "--out", "run.json"),)),
    Scenario("lightning-shardkit-3", (_py(str(ROOT / "tests" / "_lightning_script.py"), "--strategy",
                                          "shardkit", "--devices", "3", "--summary", "--steps", "1",
                                          "--out", "run.json"),)),
    Scenario("no-shutdown-exit", (_py("-m", "shardkit", "launch", "--nproc", "2",
                                      str(ROOT / "tests" / "_clean_exit_script.py")),)),
    # A restartable job with background saves to its end (issue 55: rank 0 aborted at exit once
    # in tests/test_elastic_restart.py [background]); no restart allowed, so an abort fails it.
    Scenario("elastic-background-saves",
             (_py("-m", "shardkit", "launch", "--nproc", "2", "--max-restarts", "0",
                  str(ROOT / "examples" / "elastic_resume.py"), "--ckpt-dir", "ckpt", "--steps",
                  "40", "--every", "5", "--background", "--export", "final"),)),
    Scenario("background-save-then-reload",
             (_py("-m", "shardkit", "launch", "--nproc", "2", "save.py"),
              _py("-m", "shardkit", "launch", "--nproc", "2", "reload.py")),
             files=(("save.py", BACKGROUND_SAVE), ("reload.py", RELOAD))),
    *(Scenario(name, (_test(node),), timeout_s=seconds)
      for name, (node, seconds) in TEST_SCENARIOS.items()),
)}


def _hog() -> None:
    while True:
        pass


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SHARDKIT_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                "LOCAL_WORLD_SIZE", "NODE_RANK", "TORCHELASTIC", "GROUP_RANK"))}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONFAULTHANDLER="1")
    return env


def _cores_on() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def _backtraces(folder: Path) -> None:
    """Every thread's stack from each core in `folder`, into backtrace.txt (gdb, where installed)."""
    cores = sorted(p for p in folder.rglob("core*") if p.is_file())
    if not cores or shutil.which("gdb") is None:
        return
    with open(folder / "backtrace.txt", "w") as out:
        for core in cores:
            out.write(f"=== {core}\n")
            out.flush()
            subprocess.run(["gdb", "-batch", "-ex", "info threads", "-ex", "thread apply all bt",
                            sys.executable, str(core)], stdout=out, stderr=subprocess.STDOUT,
                           timeout=300)


def run_once(scenario: Scenario, folder: Path) -> tuple[bool, float, str]:
    """One run in `folder`: (passed, seconds, why it failed)."""
    folder.mkdir(parents=True)
    for name, text in scenario.files:
        (folder / name).write_text(text)
    start = time.monotonic()
    with open(folder / "log", "w") as log:
        for command in scenario.commands:
            log.write(f"$ {' '.join(command)}\n")
            log.flush()
            try:
                proc = subprocess.run(command, cwd=folder, env=_clean_env(), stdout=log,
                                      stderr=subprocess.STDOUT, timeout=scenario.timeout_s,
                                      preexec_fn=_cores_on)
            except subprocess.TimeoutExpired:
                return False, time.monotonic() - start, f"timed out after {scenario.timeout_s:.0f} s"
            if proc.returncode != 0:
                return False, time.monotonic() - start, f"exit {proc.returncode}"
    said = (folder / "log").read_text(errors="replace")
    if "terminate called" in said:
        return False, time.monotonic() - start, "a process printed 'terminate called'"
    return True, time.monotonic() - start, ""


def main() -> None:
    """Run the chosen scenarios --runs times each beside --hog busy processes; print a table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--hog", type=int, default=os.cpu_count() or 2, help="busy processes beside")
    p.add_argument("--only", nargs="*", choices=sorted(SCENARIOS), help="scenarios to run")
    p.add_argument("--keep", default=None, help="folder for the runs (default: a temporary one)")
    args = p.parse_args()
    base = Path(args.keep or tempfile.mkdtemp(prefix="shardkit-soak-"))
    hogs = [multiprocessing.Process(target=_hog, daemon=True) for _ in range(args.hog)]
    for hog in hogs:
        hog.start()
    results = []
    try:
        for name in args.only or list(SCENARIOS):
            failures, times, first = 0, [], None
            for i in range(args.runs):
                folder = base / name / f"run{i:03d}"
                passed, seconds, why = run_once(SCENARIOS[name], folder)
                times.append(seconds)
                if passed:
                    shutil.rmtree(folder, ignore_errors=True)
                    continue
                failures += 1
                print(f"{name} run {i}: {why} ({folder})", flush=True)
                if first is None:
                    first = folder
                    _backtraces(folder)
                else:
                    shutil.rmtree(folder, ignore_errors=True)  # the first failing log is kept
            results.append((name, failures, len(times), max(times), first))
            print(f"{name}: {failures}/{len(times)} failed, worst {max(times):.1f} s", flush=True)
    finally:
        for hog in hogs:
            hog.terminate()
    print(f"\n{'scenario':30} {'failed':>8} {'worst s':>8}  first failure kept")
    for name, failures, runs, worst, first in results:
        print(f"{name:30} {failures:>3}/{runs:<4} {worst:>8.1f}  {first or '-'}")


if __name__ == "__main__":
    main()
