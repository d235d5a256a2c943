"""Read rank, world size and rendezvous address from whichever launcher started this process."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from .errors import ShardkitError

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500

# (launcher, rank var, world-size var, local-rank var, local-world-size var); first match wins.
_LAUNCHERS = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
     "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("mpich/intel-mpi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
)

JOB_ID_ENV = "SHARDKIT_JOB_ID"
# shardkit.spawn names its jobs with this prefix; its ranks carry torchrun's variables, and the
# prefix tells them (and their logs) that shardkit.spawn, not torchrun, started them.
SPAWN_JOB_PREFIX = "shardkit.spawn/"
# Variables whose value is the same for every rank of one job and differs between jobs; first
# match wins. torchrun's run id is "none" unless --rdzv-id or --standalone set it.
_JOB_ID_VARS = (JOB_ID_ENV, "TORCHELASTIC_RUN_ID", "OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE",
                "SLURM_JOB_ID")


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, and how the ranks find each other."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int | None  # None: a lone process that needs no rendezvous
    launcher: str
    job_id: str | None = None  # e.g. "SLURM_JOB_ID=1234": what tells this job from another
    # The job's store, joined (and checked to be this job's) by shardkit.init() before the
    # backend makes its process group (rendezvous.with_job_store); None for a lone process.
    store: Any = field(default=None, compare=False, repr=False)

    def export(self, environ: dict[str, str] | None = None) -> None:
        """Write the torch env:// variables so torch.distributed and child libraries agree.

        Written into os.environ (the default), the values they replace are kept until
        restore_environ() (shutdown()) puts them back.
        """
        values = {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size),
                  "LOCAL_RANK": str(self.local_rank),
                  "LOCAL_WORLD_SIZE": str(self.local_world_size), "MASTER_ADDR": self.master_addr}
        if self.master_port is not None:
            values["MASTER_PORT"] = str(self.master_port)
        if environ is None:
            for name in values:
                _replaced_environ.setdefault(name, os.environ.get(name))
            os.environ.update(values)
        else:
            environ.update(values)


# name -> its value before init() exported the launch variables (None: it was unset). A notebook
# that joins a one-process job and later starts a launcher (Lightning's devices=2, torchrun)
# would otherwise hand its children this process's RANK=0, WORLD_SIZE=1, LOCAL_WORLD_SIZE=1.
_replaced_environ: dict[str, str | None] = {}


def restore_environ() -> None:
    """Put back the environment variables export() replaced in os.environ (shutdown())."""
    for name, value in _replaced_environ.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _replaced_environ.clear()


def _int(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise ShardkitError(f"environment variable {name}={environ[name]!r} is not an integer; "
                            "fix the launcher command or unset it") from None


def _local_size(environ: Mapping[str, str], var: str, launcher: str, world_size: int) -> int:
    raw = environ.get(var)
    if raw is None and launcher == "slurm":
        return _slurm_tasks_on_this_node(environ, world_size)
    if raw is None:
        return world_size
    if launcher == "slurm":  # SLURM_NTASKS_PER_NODE may read "4(x2)" on heterogeneous jobs
        raw = raw.split("(")[0]
    return _int({var: raw}, var)


def _slurm_tasks_on_this_node(environ: Mapping[str, str], world_size: int) -> int:
    """How many tasks srun started on this node: SLURM_NTASKS_PER_NODE is set only when the job
    asked for --ntasks-per-node; SLURM_STEP_TASKS_PER_NODE (or SLURM_TASKS_PER_NODE) is always
    there, one count per node in node order, runs compressed as "2(x3),1"."""
    raw = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if not raw:
        return world_size
    counts: list[int] = []
    for part in raw.split(","):
        count, _, times = part.partition("(x")
        counts += [_int({"SLURM_TASKS_PER_NODE": count}, "SLURM_TASKS_PER_NODE")] * (
            _int({"SLURM_TASKS_PER_NODE": times.rstrip(")")}, "SLURM_TASKS_PER_NODE") if times else 1)
    node = _int(environ, "SLURM_NODEID") if "SLURM_NODEID" in environ else 0
    return counts[node] if node < len(counts) else counts[0]


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list, which srun writes compressed: "n[01-04,07],gpu3" is
    n01, n02, n03, n04, n07, gpu3 (the leading zeros are part of the name)."""
    name = nodelist.split(",")[0] if "[" not in nodelist.split(",")[0] else nodelist
    prefix, bracket, rest = name.partition("[")
    if not bracket:
        return prefix.strip()
    first = rest.split("]")[0].split(",")[0].split("-")[0]
    return prefix.strip() + first


def _rendezvous_address(environ: Mapping[str, str], launcher: str, world_size: int,
                        local_world_size: int) -> str:
    """MASTER_ADDR where the launcher set it or it can be read off the job (SLURM's first node);
    127.0.0.1 for a job on one node. A job across nodes with neither cannot guess rank 0's host:
    every other node would wait on its own loopback until the timeout, so it is refused."""
    if "MASTER_ADDR" in environ:
        return environ["MASTER_ADDR"]
    if local_world_size >= world_size or launcher in ("torchrun", "shardkit.spawn"):
        return DEFAULT_MASTER_ADDR
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") \
        or environ.get("SLURM_NODELIST")
    if launcher == "slurm" and nodelist:
        return first_host(nodelist)
    how = {"openmpi": "mpirun -x MASTER_ADDR=<host of rank 0> -x MASTER_PORT=<free port> ...",
           "mpich/intel-mpi": "mpiexec -genv MASTER_ADDR <host of rank 0> ...",
           "slurm": "export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | "
                    "head -n 1) in the batch script"}[launcher]
    raise ShardkitError(
        f"{launcher} started {world_size} ranks over several nodes ({local_world_size} on this "
        "one) and MASTER_ADDR is not set, so the ranks on other nodes cannot find rank 0's "
        f"rendezvous (127.0.0.1 is each node's own). HINT: {how}")


def job_identity(environ: Mapping[str, str] | None = None) -> str | None:
    """Name this job as "VAR=value" from the first launcher variable that identifies it, or None."""
    environ = os.environ if environ is None else environ
    for var in _JOB_ID_VARS:
        value = environ.get(var, "").strip()
        if value and not (var == "TORCHELASTIC_RUN_ID" and value == "none"):
            if var == "SLURM_JOB_ID" and environ.get("SLURM_STEP_ID"):
                value = f"{value}.{environ['SLURM_STEP_ID']}"
            return f"{var}={value}"
    return None


def detect_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Return the LaunchEnv described by environment variables; a bare process is rank 0 of 1."""
    environ = os.environ if environ is None else environ
    addr = environ.get("MASTER_ADDR", DEFAULT_MASTER_ADDR)
    for launcher, rank_var, size_var, local_var, local_size_var in _LAUNCHERS:
        if rank_var in environ and size_var in environ:
            rank, world_size = _int(environ, rank_var), _int(environ, size_var)
            if not 0 <= rank < world_size:
                raise ShardkitError(f"{launcher} says rank {rank} of world size {world_size}; "
                                    "rank must be in [0, world_size)")
            local_rank = _int(environ, local_var) if local_var in environ else rank
            port: int | None = (_int(environ, "MASTER_PORT") if "MASTER_PORT" in environ
                                else DEFAULT_MASTER_PORT)
            if world_size == 1 and "MASTER_PORT" not in environ:
                port = None
            if launcher == "torchrun" and environ.get(JOB_ID_ENV, "").startswith(SPAWN_JOB_PREFIX):
                launcher = "shardkit.spawn"
            local_size = _local_size(environ, local_size_var, launcher, world_size)
            return LaunchEnv(rank, world_size, local_rank, local_size,
                             _rendezvous_address(environ, launcher, world_size, local_size),
                             port, launcher, job_identity(environ))
    lone_port = _int(environ, "MASTER_PORT") if "MASTER_PORT" in environ else None
    return LaunchEnv(0, 1, 0, 1, addr, lone_port, "none", job_identity(environ))
