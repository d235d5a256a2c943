"""The CPU backend: gloo collectives on host memory; runs anywhere torch runs."""

from __future__ import annotations

import datetime
from typing import Any

import torch
from typing_extensions import override

from shardkit import Backend, Capabilities, Group, ReduceOp, Work, hookimpl
from shardkit.backend import check_flat_sizes, process_memory
from shardkit.launch_env import LaunchEnv
from shardkit.logs import logger
from shardkit.handles import ComposedWork


class CPUBackend(Backend):
    """Host tensors and gloo: the default that needs nothing but torch."""

    name = "cpu"
    device_type = "cpu"
    priority = 0
    collective_libraries = ("gloo",)  # "cuda+gloo": CUDA tensors through these collectives
    # gloo runs collectives on its own threads, so async handles overlap with compute.
    # A host job has no first compile to wait for: a silent peer is dead after 30 s.
    # No exact_reduce_ops: gloo's AVG (torch >= 2.8) is itself a SUM then a divide, so it would
    # save no kernel, and older gloo has none.
    # Host copies run on the compute cores at memory speed, as slow per byte as gloo itself:
    # params of 1M+ elements skip the copy-out and gradient packing (sharding/step/buckets.py).
    capabilities = Capabilities(has_streams=False, async_collectives=True,
                                supports_storage_resize=True, shard_alignment=1,
                                direct_collective_numel=1 << 20,
                                # gloo's worker thread drops a finished collective's work
                                # (and with it the tensors) a moment after wait() returned,
                                # later still when it is descheduled on a loaded machine.
                                # Buffers the engine drops itself are freed in place; the
                                # planner counts the largest other tensor let go.
                                collective_tensors_linger=True,
                                default_timeout=datetime.timedelta(seconds=30))

    @override
    @classmethod
    def is_available(cls) -> bool:
        """Available whenever torch.distributed was built with gloo."""
        import torch.distributed as dist

        return dist.is_available() and dist.is_gloo_available()

    @override
    @classmethod
    def unavailable_reason(cls) -> str:
        """Explain which part of torch.distributed is missing."""
        import torch.distributed as dist

        if not dist.is_available():
            return "this torch build has no torch.distributed"
        return "this torch build has no gloo backend"

    @override
    @classmethod
    def requirement_hint(cls) -> str:
        """The CPU backend needs only a standard torch build."""
        return "pip install 'torch>=2.9' (a build with torch.distributed and gloo)"

    @override
    @classmethod
    def versions(cls) -> dict[str, str]:
        """Report torch, whose bundled gloo this backend uses."""
        return {"torch": torch.__version__}

    @override
    def local_device(self, local_rank: int) -> torch.device:
        """Every rank computes on the host."""
        return torch.device("cpu")

    @override
    def device_count(self) -> int:
        """One host device per process."""
        return 1

    @override
    def process_group_backend(self) -> str:
        """gloo: the CPU collective library shipped inside torch."""
        return "gloo"

    @override
    def init_process_group(self, env: LaunchEnv, timeout: datetime.timedelta) -> Group:
        """Join the job's gloo group; across nodes, pick gloo's interface if the host name is loopback."""
        import os
        import socket

        from .interface import gloo_interface

        name = gloo_interface(os.environ, env.world_size, env.local_world_size, env.master_addr,
                              socket.gethostname())
        if name is not None:
            logger.info("GLOO_SOCKET_IFNAME=%s: the host name resolves to loopback, and %s is "
                        "the interface toward MASTER_ADDR %s", name, name, env.master_addr)
            os.environ["GLOO_SOCKET_IFNAME"] = name
        return super().init_process_group(env, timeout)

    @override
    def fault_tolerant_process_group(self, timeout: datetime.timedelta) -> Any:
        """torchft's gloo group, rebuilt by its Manager whenever the quorum of replica groups changes."""
        from shardkit.fault_tolerance import require_torchft

        require_torchft()
        from torchft.process_group import ProcessGroupGloo

        return ProcessGroupGloo(timeout=timeout)

    @override
    def indexed_device(self, index: int) -> torch.device:
        """Always the host: torch has one CPU device, so an index (a launcher's LOCAL_RANK) means nothing."""
        return torch.device("cpu")

    @override
    def max_local_ranks(self) -> int | None:
        """Unlimited: ranks are host processes sharing the CPU cores."""
        return None

    @override
    def set_device(self, device: torch.device) -> None:
        """Nothing to select on the host."""

    @override
    def synchronize(self, device: torch.device | None = None) -> None:
        """Host work is synchronous."""

    @override
    def memory_stats(self, device: torch.device | None = None) -> dict[str, int]:
        """Resident and peak resident memory of this process."""
        return process_memory()

    @override
    def reset_peak_memory(self, device: torch.device | None = None) -> None:
        """The kernel keeps one peak per process; it cannot be reset."""

    @override
    def ddp_kwargs(self, device: torch.device) -> dict[str, Any]:
        """DDP on CPU takes no device_ids."""
        return {}

    # gloo's flat all-gather and reduce-scatter stage every byte through an extra full-size
    # buffer and run 2-3x slower than the same bytes moved by its broadcast and all-reduce
    # (benchmarks/bench_gloo.py, 2 ranks, 83M fp32: all-gather 534 ms vs 118 ms as broadcasts,
    # reduce-scatter 603 ms vs 284 ms as an in-place all-reduce). Both are rebuilt from those, through
    # Backend's own methods so that a subclass overriding one collective changes only that one.
    @override
    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, group: Group,
                               async_op: bool = False) -> Work:
        """Concatenate every rank's `input` into `output`: each rank broadcasts its block in place."""
        if group.size == 1 or not output.is_contiguous():  # a local copy, or gloo's own
            return super().all_gather_into_tensor(output, input, group, async_op)
        check_flat_sizes("all_gather_into_tensor", "output", output, "input", input, group)
        blocks = output.view(group.size, -1)
        own = blocks[group.rank]
        if input.data_ptr() != own.data_ptr() or not input.is_contiguous():
            own.copy_(input.reshape(-1))  # the engine gathers in place: this copy is skipped
        work = ComposedWork([Backend.broadcast(self, blocks[i], i, group, async_op=True)
                             for i in range(group.size)])
        if not async_op:
            work.wait()
        return work

    @override
    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, group: Group,
                              op: str = ReduceOp.SUM, async_op: bool = False, *,
                              factor: float | None = None) -> Work:
        """Reduce `input` across ranks into this rank's slice: an in-place all-reduce, then the slice."""
        if group.size == 1:
            return super().reduce_scatter_tensor(output, input, group, op, async_op, factor=factor)
        check_flat_sizes("reduce_scatter_tensor", "input", input, "output", output, group)
        summed = input.reshape(-1)  # `input` is consumed (Backend's contract): no copy of it
        mine = summed.view(group.size, -1)[group.rank]
        work = ComposedWork([Backend.all_reduce(self, summed, group, op, async_op=True,
                                                 factor=factor)],
                            finish=lambda: output.copy_(mine.view(output.shape)))
        if not async_op:
            work.wait()
        return work


@hookimpl
def shardkit_register_backends(registry):
    """Register the CPU backend."""
    registry.add(CPUBackend)
