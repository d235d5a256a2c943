"""Join the job's store, and make sure it is this job's: ranks of two jobs never meet.

torch's env:// rendezvous connects to whatever store listens on MASTER_ADDR:MASTER_PORT. When a
second job starts on a port a running job already uses (both left MASTER_PORT unset, so both
took the default), its rank 0 fails to listen (EADDRINUSE) while its other ranks connect to the
*first* job's store, read that job's addresses and pair with its ranks: a hang past every
timeout, or collectives with strangers. So before torch sees the store, rank 0 writes a job
record into it and every rank claims its rank number there. A rank that finds another job's
record (another job id, another world size) or its rank number already claimed by another
process fails within seconds, naming the port, the other job and the fix. Where no launcher names
the job (a hand-made RANK/WORLD_SIZE launch), the rank claim alone still catches the second job.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import ShardkitError
from ..failure.node import node_identity
from ..launch_env import DEFAULT_MASTER_PORT, JOB_ID_ENV, LaunchEnv

_PREFIX = "shardkit/rendezvous/"
# How long rank 0, refused its port, waits for the port's owner to say which job it is.
_OWNER_PROBE_S = 3.0
FIX_HINT = (f"HINT: give each job its own port (MASTER_PORT=<free port>, and a {JOB_ID_ENV} of "
            "its own if you launch ranks by hand), or start the job with `shardkit launch` or "
            "shardkit.spawn, which pick a free port")


class JobStoreError(ShardkitError):
    """This rank could not join its own job's store (port taken, another job there, no store)."""


@dataclass(frozen=True)
class JobRecord:
    """What rank 0 writes into the store it opens, so a joining rank can tell whose store it is."""

    job_id: str | None
    world_size: int
    host: str
    pid: int
    launcher: str

    def describe(self) -> str:
        """The job in words: its id if it has one, its size and where its rank 0 runs."""
        name = self.job_id or "a job with no launcher id"
        return f"{name} (world size {self.world_size}, rank 0 is pid {self.pid} on {self.host})"


def record_for(env: LaunchEnv) -> JobRecord:
    """This rank's view of the job record rank 0 writes."""
    return JobRecord(env.job_id, env.world_size, socket.gethostname(), os.getpid(), env.launcher)


def conflict(env: LaunchEnv, record: JobRecord, claimed_by: str, me: str) -> str | None:
    """Why the store holding `record` (rank env.rank claimed by `claimed_by`) is not this job's, or None."""
    if record.world_size != env.world_size:
        return f"it belongs to a job of world size {record.world_size}, this one has {env.world_size}"
    if record.job_id != env.job_id and record.job_id is not None and env.job_id is not None:
        return f"it belongs to job {record.job_id}, this rank is in job {env.job_id}"
    if claimed_by != me:
        return (f"rank {env.rank} of that job already joined it ({_shown(claimed_by)}); this "
                f"process ({_shown(me)}) is another rank {env.rank}")
    return None


def with_job_store(env: LaunchEnv, timeout: datetime.timedelta) -> LaunchEnv:
    """`env` holding the job's store, joined and checked (`join_job_store`), where a process
    group is still to be made over the network; otherwise `env` as it is."""
    import dataclasses

    import torch.distributed as dist

    if env.master_port is None or env.store is not None or dist.is_initialized():
        return env
    env.export()
    return dataclasses.replace(env, store=join_job_store(env, timeout))


def join_job_store(env: LaunchEnv, timeout: datetime.timedelta) -> Any:
    """Open or join the job's store at env.master_addr:master_port, checked to be this job's."""
    import torch.distributed as dist

    assert env.master_port is not None
    env.export()  # env:// reads them (the caller may have exported them already)
    try:
        store, _, _ = next(dist.rendezvous("env://", env.rank, env.world_size, timeout=timeout))
    except RuntimeError as exc:
        raise _rendezvous_error(env, timeout, exc) from exc
    store.set_timeout(timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    record_key = f"{_PREFIX}{attempt}/job"
    mine = record_for(env)
    if env.rank == 0:
        store.compare_set(record_key, "", json.dumps(asdict(mine)))
    # The node identity tells apart two containers that share a hostname and a pid number.
    me = f"pid {os.getpid()} on {socket.gethostname()}|{node_identity()}"
    try:
        # compare_set returns the key's value: ours when we claimed it (or already had it).
        claimed_by = store.compare_set(f"{_PREFIX}{attempt}/rank/{env.rank}", "", me).decode()
        record = JobRecord(**json.loads(store.get(record_key)))
    except RuntimeError as exc:
        raise JobStoreError(
            f"rank {env.rank} reached the store at {_where(env)} but its job record never came "
            f"within timeout={timeout.total_seconds():g} s: the store is not this job's, or this "
            f"job's rank 0 failed before writing it ({exc}). {FIX_HINT}") from exc
    why = conflict(env, record, claimed_by, me)
    if why is not None:
        raise JobStoreError(
            f"rank {env.rank} connected to the store at {_where(env)}, but {why}: another job is "
            f"using that port: {record.describe()}. This job's rank 0 most likely failed to "
            f"listen there (address already in use). {FIX_HINT}")
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:
        # torchrun keeps one store across --max-restarts attempts: without a prefix per attempt,
        # restarted ranks read the dead ranks' gloo addresses (a connect timeout minutes later)
        # and the failure board's report of the rank that died (a false stop).
        return dist.PrefixStore(f"{_PREFIX}{attempt}/keys", store)
    return store


def _shown(claim: str) -> str:
    return claim.partition("|")[0]


def _where(env: LaunchEnv) -> str:
    default = "" if env.master_port != DEFAULT_MASTER_PORT else " (shardkit's default port)"
    return f"{env.master_addr}:{env.master_port}{default}"


def _rendezvous_error(env: LaunchEnv, timeout: datetime.timedelta, exc: RuntimeError) -> JobStoreError:
    text = str(exc)
    if "EADDRINUSE" in text or "address already in use" in text.lower():
        return JobStoreError(
            f"rank {env.rank} could not open the job's store: port {_where(env)} is already in "
            f"use by {port_owner(env.master_addr, env.master_port)}. {FIX_HINT}")
    return JobStoreError(
        f"rank {env.rank} could not reach the job's store at {_where(env)} within "
        f"timeout={timeout.total_seconds():g} s: rank 0 opens it, so rank 0 has not started or "
        f"failed (look at its error; a port in use by another job is the usual cause). "
        f"{FIX_HINT}. ({type(exc).__name__}: {text.splitlines()[0] if text else ''})")


def port_owner(addr: str, port: int | None) -> str:
    """Describe whatever listens on addr:port: another shardkit job's record, or what is known."""
    from torch.distributed import TCPStore

    try:
        client = TCPStore(addr, int(port or 0), is_master=False,
                          timeout=datetime.timedelta(seconds=_OWNER_PROBE_S))
        keys = [key for key in _candidate_record_keys() if client.check([key])]
        if keys:
            return f"another shardkit job, {JobRecord(**json.loads(client.get(keys[0]))).describe()}"
        return "another job's torch store (not one shardkit opened, or an older shardkit)"
    except Exception:  # noqa: BLE001 - not a store at all, or it went away meanwhile
        return "another process (not a torch store)"


def _candidate_record_keys() -> list[str]:
    return [f"{_PREFIX}{attempt}/job" for attempt in range(4)]
