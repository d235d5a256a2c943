"""Rank, world size and rendezvous come from whichever launcher started the process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shardkit import LaunchEnv, ShardkitError, detect_launch_env
from shardkit.job.spawn import free_port

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without any launcher's variables (and shardkit's own), plus `extra`."""
    prefixes = ("OMPI_", "PMI_", "MPI_", "SLURM_", "SHARDKIT_", "PMIX_")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith(prefixes)}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def test_bare_process_is_rank_0_of_1() -> None:
    """No launcher: world size 1, no port to open."""
    assert detect_launch_env({}) == LaunchEnv(0, 1, 0, 1, "127.0.0.1", None, "none")


def test_bare_process_keeps_an_explicit_port() -> None:
    """MASTER_ADDR/MASTER_PORT alone do not make a multi-process job."""
    env = detect_launch_env({"MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "1234"})
    assert (env.rank, env.world_size, env.master_addr, env.master_port) == (0, 1, "10.0.0.5", 1234)


def test_torchrun_variables() -> None:
    """torchrun / torch elastic set RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE."""
    env = detect_launch_env({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                             "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "node0", "MASTER_PORT": "29511"})
    assert env == LaunchEnv(5, 8, 1, 4, "node0", 29511, "torchrun")


def test_torchrun_defaults_address_and_port() -> None:
    """Without MASTER_ADDR/PORT a multi-rank job uses 127.0.0.1:29500."""
    env = detect_launch_env({"RANK": "1", "WORLD_SIZE": "2"})
    assert (env.local_rank, env.local_world_size, env.master_addr, env.master_port) == (1, 2, "127.0.0.1", 29500)


def test_single_rank_torchrun_needs_no_port() -> None:
    """RANK=0 WORLD_SIZE=1 without MASTER_PORT is a lone process: no rendezvous port."""
    assert detect_launch_env({"RANK": "0", "WORLD_SIZE": "1"}).master_port is None


def test_openmpi_variables() -> None:
    """mpirun from Open MPI sets OMPI_COMM_WORLD_*."""
    env = detect_launch_env({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
                             "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                             "MASTER_ADDR": "head"})
    assert env == LaunchEnv(3, 4, 1, 2, "head", 29500, "openmpi")


def test_pmi_variables() -> None:
    """MPICH / Intel MPI set PMI_RANK and PMI_SIZE (local rank from MPI_LOCALRANKID)."""
    env = detect_launch_env({"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "0",
                             "MPI_LOCALNRANKS": "1", "MASTER_ADDR": "head"})
    assert env == LaunchEnv(2, 3, 0, 1, "head", 29500, "mpich/intel-mpi")


@pytest.mark.parametrize("environ, hint", [
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, "mpirun -x MASTER_ADDR="),
    ({"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1"},
     "mpiexec -genv MASTER_ADDR"),
    ({"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2", "SLURM_NTASKS_PER_NODE": "4"},
     "scontrol show hostnames"),
])
def test_a_job_across_nodes_without_a_rendezvous_host_is_refused(environ, hint) -> None:
    """Each node's 127.0.0.1 is its own: the other nodes would wait there until the timeout."""
    with pytest.raises(ShardkitError, match="MASTER_ADDR is not set") as err:
        detect_launch_env(environ)
    assert hint in str(err.value)


@pytest.mark.parametrize("nodelist, first", [("n[01-04,07],gpu3", "n01"), ("gpu3,n[1-2]", "gpu3"),
                                             ("node7", "node7"), ("a,b", "a"),
                                             ("rack1-n[003-005]", "rack1-n003")])
def test_slurm_node_lists_give_their_first_host(nodelist, first) -> None:
    """srun compresses node lists; the first node (where srun puts task 0) is the rendezvous."""
    env = detect_launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_NODEID": "0",
                             "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_NODELIST": nodelist})
    assert env.master_addr == first and env.local_world_size == 2


def test_slurm_tasks_on_this_node_without_ntasks_per_node() -> None:
    """SLURM_NTASKS_PER_NODE exists only under --ntasks-per-node; SLURM_TASKS_PER_NODE always."""
    base = {"SLURM_PROCID": "7", "SLURM_NTASKS": "8", "SLURM_TASKS_PER_NODE": "3(x2),2",
            "SLURM_JOB_NODELIST": "n[1-3]"}
    assert detect_launch_env({**base, "SLURM_NODEID": "2"}).local_world_size == 2
    assert detect_launch_env({**base, "SLURM_NODEID": "1"}).local_world_size == 3
    # A step's own layout wins over the allocation's.
    assert detect_launch_env({**base, "SLURM_NODEID": "0",
                              "SLURM_STEP_TASKS_PER_NODE": "4,4"}).local_world_size == 4


def test_pmi_without_local_rank_uses_the_global_one() -> None:
    """Without a local-rank variable the process is assumed to be alone on a single node."""
    env = detect_launch_env({"PMI_RANK": "1", "PMI_SIZE": "2"})
    assert (env.local_rank, env.local_world_size) == (1, 2)


def test_slurm_variables() -> None:
    """srun sets SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID and SLURM_NTASKS_PER_NODE."""
    env = detect_launch_env({"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2",
                             "SLURM_NTASKS_PER_NODE": "4", "MASTER_PORT": "4000",
                             "SLURM_JOB_NODELIST": "node[3-4]"})
    assert env == LaunchEnv(6, 8, 2, 4, "node3", 4000, "slurm")


def test_slurm_heterogeneous_tasks_per_node() -> None:
    """SLURM writes repeated counts as "4(x2)"; the count per node is the leading number."""
    env = detect_launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "8",
                             "SLURM_NTASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "n[1-2]"})
    assert env.local_world_size == 4


def test_torchrun_wins_over_an_outer_launcher() -> None:
    """torchrun inside an srun allocation: torchrun's own ranks are the ones that count."""
    env = detect_launch_env({"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0",
                             "SLURM_NTASKS": "1"})
    assert (env.rank, env.world_size, env.launcher) == (1, 2, "torchrun")


def test_export_writes_the_torch_variables() -> None:
    """export() gives torch.distributed's env:// init everything it reads."""
    environ: dict[str, str] = {}
    LaunchEnv(2, 4, 0, 2, "host", 1234, "slurm").export(environ)
    assert environ == {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "host", "MASTER_PORT": "1234"}


@pytest.mark.parametrize("environ,names", [
    ({"RANK": "one", "WORLD_SIZE": "2"}, ["RANK", "'one'", "not an integer"]),
    ({"RANK": "0", "WORLD_SIZE": "2.0"}, ["WORLD_SIZE", "not an integer"]),
    ({"RANK": "2", "WORLD_SIZE": "2"}, ["rank 2 of world size 2", "[0, world_size)"]),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, ["rank -1"]),
    ({"RANK": "0", "WORLD_SIZE": "0"}, ["world size 0"]),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "http"}, ["MASTER_PORT", "not an integer"]),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "x"}, ["LOCAL_RANK", "not an integer"]),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": ""}, ["LOCAL_WORLD_SIZE", "not an integer"]),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "two"},
     ["SLURM_NTASKS_PER_NODE", "not an integer"]),
    ({"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "4"}, ["openmpi", "rank 4"]),
    ({"MASTER_PORT": "99999999999999999999x"}, ["MASTER_PORT"]),
])
def test_bad_values_give_clear_errors(environ: dict[str, str], names: list[str]) -> None:
    """Garbage from a launcher is a ShardkitError naming the variable, not a bare ValueError."""
    with pytest.raises(ShardkitError) as info:
        detect_launch_env(environ)
    for name in names:
        assert name in str(info.value)


TORCHRUN_WORKER = textwrap.dedent("""
    import json, torch, shardkit
    ctx = shardkit.init()
    t = torch.tensor([float(ctx.rank + 1), 10.0 * (ctx.rank + 1)])
    ctx.backend.all_reduce(t, ctx.world).wait()
    print(json.dumps({"rank": ctx.rank, "size": ctx.world_size, "local": ctx.local_rank,
                      "launcher": ctx.env.launcher, "backend": ctx.backend.name,
                      "sum": t.tolist()}), flush=True)
    shardkit.shutdown()
""")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_torchrun_two_processes_all_reduce(tmp_path: Path) -> None:
    """`python -m torch.distributed.run --nproc_per_node 2` + shardkit.init() + all_reduce."""
    script = tmp_path / "worker.py"
    script.write_text(TORCHRUN_WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(script)]
    proc = subprocess.run(cmd, env=clean_env(SHARDKIT_BACKEND="cpu"), capture_output=True,
                          text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reports = sorted(_json_objects(proc.stdout),
                     key=lambda r: r["rank"])
    assert reports == [
        {"rank": r, "size": 2, "local": r, "launcher": "torchrun", "backend": "cpu",
         "sum": [3.0, 30.0]} for r in range(2)]


def _json_objects(text: str) -> list[dict]:
    """Every JSON object in `text`: two ranks share one stdout, so their lines may run together."""
    decoder, found, at = json.JSONDecoder(), [], text.find("{")
    while at != -1:
        obj, end = decoder.raw_decode(text, at)
        found.append(obj)
        at = text.find("{", end)
    return found


BARE_WORKER = textwrap.dedent("""
    import json, os, torch, shardkit
    import torch.distributed as dist
    ctx = shardkit.init()
    t = torch.tensor([2.0, -3.0])
    ctx.backend.all_reduce(t, ctx.world).wait()
    print(json.dumps({"rank": ctx.rank, "size": ctx.world_size, "launcher": ctx.env.launcher,
                      "port": ctx.env.master_port,
                      "pg_matches": dist.get_backend() == ctx.backend.process_group_backend(),
                      "initialized": dist.is_initialized(), "sum": t.tolist(),
                      "same": shardkit.init() is ctx}))
    shardkit.shutdown()
    assert not dist.is_initialized() and shardkit.current_context() is None
""")


@pytest.mark.timeout(120)
def test_bare_init_is_world_size_one() -> None:
    """A plain `python script.py` with no launcher variables initialises a world of one."""
    proc = subprocess.run([sys.executable, "-c", BARE_WORKER], env=clean_env(), capture_output=True,
                          text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == {"rank": 0, "size": 1, "launcher": "none", "port": None, "pg_matches": True,
                      "initialized": True, "sum": [2.0, -3.0], "same": True}


def test_a_backend_asked_for_a_networked_group_without_the_jobs_store_says_who_joins_it(monkeypatch):
    import datetime

    import torch.distributed as dist

    from shardkit.errors import ShardkitError
    from shardkit_backends.cpu import CPUBackend

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: pytest.fail("no group without a store"))
    env = LaunchEnv(1, 2, 1, 2, "127.0.0.1", 29555, "torchrun")
    with pytest.raises(ShardkitError, match=r"rank 1 of 2 has no job store.*shardkit\.init\(\)"):
        CPUBackend().init_process_group(env, datetime.timedelta(seconds=1))
