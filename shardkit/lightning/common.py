"""What the Trainer and the Fabric strategies share: options, joining the job, sharding a module."""

from __future__ import annotations

import inspect
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ShardkitError
from ..suggest import did_you_mean
from .precision import mixed_precision_for

# shard() options the strategies set themselves (the backend, the device) or take by name.
_OWN = {"model", "backend", "device_id", "strategy", "auto_wrap_policy"}


def shard_option_names() -> list[str]:
    """The shardkit.shard() keyword arguments the strategies pass through."""
    from ..sharding.api import shard

    return sorted(set(inspect.signature(shard).parameters) - _OWN)


def check_options(owner: str, backend: str | None, shard_options: dict[str, Any]) -> None:
    """Refuse what cannot work before Lightning starts anything: the xla backend, unknown options."""
    if backend == "xla":
        raise ShardkitError(
            f"{owner}(backend='xla') is not supported: Lightning pairs its XLAAccelerator only "
            "with its own XLA strategies (any other strategy is refused when the Trainer or "
            "Fabric is built), and with accelerator='cpu' Lightning starts one process per "
            "device itself, while shardkit's xla ranks are started by XLA's launcher (threads of "
            "one process on PJRT-CPU). HINT: train on XLA without Lightning: `shardkit launch` "
            "or shardkit.spawn(fn, n, backend='xla') (docs/guide/xla.md); the same LightningModule "
            "runs on cpu/cuda with strategy='shardkit'")
    valid = shard_option_names()
    for name in shard_options:
        if name not in valid:
            raise ShardkitError(f"{owner} got an unknown option {name!r}"
                                f"{did_you_mean(name, valid)}; shard() options: "
                                f"strategy, auto_wrap_policy, {', '.join(valid)}")


def join_job(strategy: Any, backend: str | None, timeout: float | timedelta | None) -> None:
    """Start shardkit on this rank from the place Lightning's cluster environment gives it."""
    env = strategy.cluster_environment
    assert env is not None
    # What torchrun would have set: shardkit.init() reads the job from the environment and
    # makes the process group (its own rendezvous checks and failure watchdog included).
    os.environ.update(RANK=str(strategy.global_rank), WORLD_SIZE=str(strategy.world_size),
                      LOCAL_RANK=str(strategy.local_rank),
                      LOCAL_WORLD_SIZE=str(strategy.num_processes),
                      MASTER_ADDR=env.main_address, MASTER_PORT=str(env.main_port))
    from ..job.runtime import init

    init(backend or strategy.root_device.type, timeout=timeout)


def shard_module(module: torch.nn.Module, options: dict[str, Any], precision: str,
                 backend: str | None, device: torch.device) -> torch.nn.Module:
    """shard() `module` in place once (the precision flag picks MixedPrecision unless given)."""
    from ..sharding.api import shard
    from ..sharding.step.hooks import unit_of

    if unit_of(module) is not None:  # the Trainer sets up again for validate()/test() after fit()
        return module
    options = dict(options)
    if "mixed_precision" not in options:
        options["mixed_precision"] = mixed_precision_for(precision)
    return shard(module, backend=backend or device.type, device_id=device, **options)


class RankPlace:
    """Where this rank is, and the barrier and broadcast Lightning asks for, for both strategies
    (mixed in before Lightning's ParallelStrategy)."""

    parallel_devices: list[torch.device] | None
    cluster_environment: Any
    num_nodes: int
    local_rank: int
    node_rank: int
    global_rank: int

    def _keep_options(self, owner: str, strategy: Any, auto_wrap_policy: Any,
                      backend: str | None, timeout: Any, shard_options: dict[str, Any]) -> None:
        """Check and keep the shard() options (one node until Lightning says otherwise)."""
        check_options(owner, backend, shard_options)
        self._shard_options = dict(strategy=strategy, auto_wrap_policy=auto_wrap_policy,
                                   **shard_options)
        self._backend, self._timeout = backend, timeout
        self.num_nodes = 1

    @property
    def root_device(self) -> torch.device:
        """This rank's device."""
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        """Ranks on this node."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """What Lightning's DistributedSampler gets: every rank of every node."""
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    def set_world_ranks(self) -> None:
        """Tell the cluster environment this rank's global rank and the world size."""
        from lightning.fabric.utilities.rank_zero import rank_zero_only

        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes
                                                     + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    def barrier(self, name: str | None = None) -> None:
        """Wait for every rank (a no-op before the process group exists)."""
        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank `src`'s picklable `obj` on every rank."""
        if not (dist.is_available() and dist.is_initialized()):
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]
