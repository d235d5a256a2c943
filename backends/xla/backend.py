"""The XLA backend: PJRT devices, collectives through torch_xla's `xm` functions.

Why not torch_xla's process group for collectives: on CPU, torch_xla 2.9 runs every device as a
thread of one process, and torch.distributed's default group belongs to the process, so it cannot
exist once per device thread. `xm` collectives with explicit replica groups work per thread, and
on TPU (one process per chip) they are what the process group calls anyway.

Why never `xm.optimizer_step`: it all-reduces (averages) every gradient before `opt.step()`. Under
sharding the engine has already reduce-scattered and averaged them, so that would reduce a second
time (and across ranks whose shards differ). shardkit cuts the graph after `opt.step()` instead,
through the optimizer step post-hook that `shardkit.init()` installs for backends whose
capabilities set `needs_step_boundary` (see `shardkit/job/step_boundary.py`).
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import threading
from typing import Any, Callable, Sequence

import torch
from typing_extensions import override

from shardkit import Backend, Capabilities
from shardkit.backend import check_equal_split, check_flat_sizes, check_reduce_op, copy_locally, process_memory
from shardkit.errors import ShardkitError, UnsupportedOperationError
from shardkit.handles import CompletedWork, Group, ReduceOp, Work
from shardkit.install_hint import pip_install_extra
from shardkit.launch_env import LaunchEnv

from . import threads

# Per device thread: how many groups this rank has created (groups are matched by creation order).
_local = threading.local()


def _xm() -> Any:
    import torch_xla.core.xla_model as xm

    return xm


def _xr() -> Any:
    import torch_xla.runtime as xr

    return xr


class XLABackend(Backend):
    """XLA devices (TPU, or CPU with PJRT_DEVICE=CPU) through torch_xla's PJRT runtime."""

    name = "xla"
    device_type = "xla"
    priority = 10
    capabilities = Capabilities(
        has_streams=False, async_collectives=False, supports_storage_resize=False,
        shard_alignment=128,  # what XlaFullyShardedDataParallel pads flat params to (x world size)
        needs_compiler_barrier=True, needs_step_boundary=True, ranks_share_process=True,
        torch_process_group=False,  # xm collectives on replica groups; checkpoints go through the host
        reduce_ops=frozenset({ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN}),
        supported_dtypes=frozenset({torch.float32, torch.bfloat16}),
        # Measured in the XLA lane (torch_xla 2.9, PJRT-CPU): inductor fails inside dynamo on XLA
        # tensors, and "openxla" trains on stale weights (its graph keeps the parameters it first
        # saw; the engine exposes freshly gathered ones every step): the weights drift from the
        # reference by 0.04 after one step, 0.30 after five, with no error.
        compile_refusal=(
            "torch.compile of a sharded unit is not supported on XLA: inductor cannot compile XLA "
            "tensors, and torch_xla's dynamo backend (openxla) keeps the parameters it first "
            "traced while shardkit gathers fresh ones every step, so the unit would train on "
            "stale weights without an error. XLA already traces each training step lazily into "
            "one graph (cut after the optimizer step). HINT: drop .compile() / compile_layers on "
            "XLA; the step is compiled by XLA as it is"))

    # ---- availability ---------------------------------------------------------------------------
    @override
    @classmethod
    def is_available(cls) -> bool:
        """True when torch_xla is importable."""
        return importlib.util.find_spec("torch_xla") is not None

    @override
    @classmethod
    def unavailable_reason(cls) -> str:
        """torch_xla is not installed."""
        return "torch_xla is not installed"

    @override
    @classmethod
    def auto_select_now(cls) -> bool:
        """Only when PJRT_DEVICE says which XLA device to use: torch_xla must not hijack other boxes."""
        return bool(os.environ.get("PJRT_DEVICE"))

    @override
    @classmethod
    def requirement_hint(cls) -> str:
        """torch_xla must match torch exactly."""
        return (f"{pip_install_extra('xla')} (torch_xla needs the torch of the same version, e.g. "
                "torch==2.9.0 torch_xla==2.9.0) and set PJRT_DEVICE (TPU, or CPU for testing)")

    @override
    @classmethod
    def versions(cls) -> dict[str, str]:
        """torch, torch_xla and the PJRT device type asked for."""
        out = {"torch": torch.__version__, "pjrt_device": os.environ.get("PJRT_DEVICE", "")}
        try:
            import torch_xla

            out["torch_xla"] = str(torch_xla.__version__)
        except Exception as exc:  # noqa: BLE001 - versions() must not raise
            out["torch_xla"] = f"unimportable ({type(exc).__name__})"
        return out

    # ---- devices ------------------------------------------------------------------------------
    @override
    def local_device(self, local_rank: int) -> torch.device:
        """The device torch_xla assigned to this process or device thread."""
        import torch_xla

        return torch.device(str(torch_xla.device()))

    @override
    def device_count(self) -> int:
        """Addressable XLA devices in this process."""
        return int(_xr().addressable_runtime_device_count())

    @override
    def max_local_ranks(self) -> int | None:
        """PJRT_DEVICE=CPU makes as many devices as asked (CPU_NUM_DEVICES); otherwise the chips there are."""
        if os.environ.get("PJRT_DEVICE", "").upper() == "CPU":
            return None
        return self.device_count()

    @override
    def set_device(self, device: torch.device) -> None:
        """Make `device` this thread's default XLA device."""
        threads.use_device(device)

    @override
    def synchronize(self, device: torch.device | None = None) -> None:
        """Wait until every graph dispatched to the device has run."""
        threads.wait_device(device if device is not None else self.local_device(0))

    @override
    def process_group_backend(self) -> str:
        """torch_xla's process group (used only for DDP, see ddp_kwargs)."""
        return "xla"

    # ---- the job --------------------------------------------------------------------------------
    @override
    def launch_env(self) -> LaunchEnv:
        """Each device (thread or process) is a rank: ordinals come from torch_xla.runtime."""
        xr = _xr()
        world = int(xr.world_size())
        return LaunchEnv(rank=int(xr.global_ordinal()), world_size=world,
                         local_rank=int(xr.local_ordinal()),
                         local_world_size=int(xr.local_device_count()) if world > 1 else 1,
                         master_addr="127.0.0.1", master_port=None, launcher="torch_xla")

    @override
    def init_process_group(self, env: LaunchEnv, timeout: datetime.timedelta) -> Group:
        """Build this rank's world group; no torch.distributed group is needed for shardkit's collectives."""
        _local.groups_made = 0
        return self._group(tuple(range(env.world_size)), env.rank, index=0)

    def _threaded(self) -> bool:
        return self.device_count() > 1

    def _group(self, ranks: tuple[int, ...], me: int, index: int) -> Group:
        device = self.local_device(0)
        if me not in ranks:
            return Group(-1, len(ranks), ranks, None)
        barrier = threads.shared_barrier(ranks, index) if self._threaded() else None
        world = int(_xr().world_size())
        replica = [] if len(ranks) == world else [list(ranks)]
        handle = threads.ThreadGroup(me, ranks, device, barrier, replica)
        return Group(ranks.index(me), len(ranks), ranks, handle)

    @override
    def world_group(self) -> Group:
        """The group of all ranks, for this thread."""
        from shardkit.job.runtime import current_context

        ctx = current_context()
        if ctx is None or ctx.backend is not self:
            raise ShardkitError("the XLA world group exists once shardkit.init(backend='xla') ran "
                                "in this device thread")
        return ctx.world

    @override
    def new_group(self, ranks: Sequence[int]) -> Group:
        """A subgroup as an XLA replica group; every rank must call this with the same ranks, in the same order."""
        ranks = tuple(sorted(int(r) for r in ranks))
        world = int(_xr().world_size())
        if not ranks or len(set(ranks)) != len(ranks) or ranks[0] < 0 or ranks[-1] >= world:
            raise ShardkitError(f"new_group ranks {list(ranks)} must be distinct ranks in [0, {world})")
        if 1 < len(ranks) < world:
            # Every device compiles its collective for all `world` replicas, and XLA's verifier
            # rejects a graph issued by a subset only ("In cross_replica mode, replica groups
            # should contain 4 replicas, but found 2"). A partition of all ranks, each rank in its
            # own group, does run (measured), but needs every rank to issue every subgroup
            # collective at once; shardkit's groups do not promise that yet.
            raise UnsupportedOperationError(
                f"backend {self.name!r} supports groups of all {world} ranks or of one rank, not "
                f"{list(ranks)}: torch_xla 2.9 compiles every collective for all {world} devices and "
                "XLA rejects replica groups that leave ranks out ('replica groups should contain "
                f"{world} replicas, but found {len(ranks)}'), so neither HYBRID_SHARD with 1 < "
                f"hybrid_group_size < {world} nor reshard_after_forward=k with 1 < k < {world} can "
                "run. HINT: use ShardingStrategy.FULL_SHARD (or HYBRID_SHARD with "
                f"hybrid_group_size={world}) and reshard_after_forward True or False on XLA")
        _local.groups_made = getattr(_local, "groups_made", 0) + 1
        return self._group(ranks, int(_xr().global_ordinal()), index=_local.groups_made)

    @override
    def shutdown(self) -> None:
        """Wait for this device's work, and destroy torch's "xla" group if DDP made one."""
        import torch.distributed as dist

        self.synchronize()
        if dist.is_initialized() and not self._threaded():
            dist.destroy_process_group()

    # ---- collectives ----------------------------------------------------------------------------
    def _reduce_type(self, op: str, factor: float | None) -> str:
        check_reduce_op(self, op, factor)  # declares no exact_reduce_ops: XLA's AVG is unreliable
        xm = _xm()
        return {ReduceOp.SUM: xm.REDUCE_SUM, ReduceOp.MAX: xm.REDUCE_MAX,
                ReduceOp.MIN: xm.REDUCE_MIN}[op]

    def _collective(self, group: Group, tensor: torch.Tensor,
                    trace: Callable[[torch.Tensor, list[list[int]]], torch.Tensor]) -> torch.Tensor:
        """Run `trace(flat copy of tensor, replica groups)` as a graph of its own; return its result."""
        handle: threads.ThreadGroup = group.handle
        threads.use_device(handle.device)
        # A fresh flat copy, executed first: a view (the engine gathers in place, so its input is
        # this rank's row of the output) would drag its base's history, which depends on the rank,
        # into the collective's graph, and ranks whose graphs differ never meet.
        src = tensor.detach().reshape(-1).clone()
        threads.flush([src], handle.device)
        result = trace(src, handle.replica_groups)
        threads.run_collective_graph([result], handle)
        return result

    @override
    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, group: Group,
                               async_op: bool = False) -> Work:
        """Concatenate every rank's `input` into `output` along dim 0, in group rank order."""
        check_flat_sizes("all_gather_into_tensor", "output", output, "input", input, group)
        if group.size == 1:
            return copy_locally(output, input)
        # pin_layout=False: the pinned variant is an all-reduce padded by ordinal, a graph that
        # differs per rank and never meets.
        gathered = self._collective(group, input, lambda src, groups: _xm().all_gather(
            src, dim=0, groups=groups, pin_layout=False))
        output.copy_(gathered.view(output.shape))
        return CompletedWork()

    @override
    def fault_tolerant_process_group(self, timeout: datetime.timedelta) -> Any:
        """Refused: torchft's groups run eager c10d collectives, XLA's are traced into the step's graph."""
        raise UnsupportedOperationError(
            "fault tolerance across replica groups is not available on XLA: torchft's Manager "
            "runs its all-reduce as an eager torch.distributed collective on a process group it "
            "rebuilds whenever the quorum changes, while XLA's collectives are ops traced into "
            "the step's compiled graph over a fixed PJRT mesh, which no torchft process group "
            "can join or leave. HINT: on TPU, restart the job from its last checkpoint "
            "(`shardkit launch --max-restarts N` with shardkit.checkpoint), or run the "
            "fault-tolerant job on cpu, cuda or xpu")

    @override
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, group: Group,
                          async_op: bool = False) -> Work:
        """Send the i-th equal slice of `input` to group rank i; receive each rank's slice for this one."""
        check_equal_split("all_to_all_single", output, input, group)
        if group.size == 1:
            return copy_locally(output, input)
        moved = self._collective(group, input, lambda src, groups: _xm().all_to_all(
            src, split_dimension=0, concat_dimension=0, split_count=group.size, groups=groups,
            pin_layout=False))
        output.copy_(moved.view(output.shape))
        return CompletedWork()

    @override
    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, group: Group,
                              op: str = ReduceOp.SUM, async_op: bool = False, *,
                              factor: float | None = None) -> Work:
        """Reduce `input` across ranks and leave this rank's equal slice in `output`."""
        reduce_type = self._reduce_type(op, factor)
        check_flat_sizes("reduce_scatter_tensor", "input", input, "output", output, group)
        if group.size == 1:
            return copy_locally(output, input)
        part = self._collective(group, input, lambda src, groups: _xm().reduce_scatter(
            reduce_type, src, 1.0, 0, group.size, groups=groups, pin_layout=False))
        output.copy_(part.view(output.shape))
        return CompletedWork()

    @override
    def all_reduce(self, tensor: torch.Tensor, group: Group, op: str = ReduceOp.SUM,
                   async_op: bool = False, *, factor: float | None = None) -> Work:
        """Reduce `tensor` across ranks in place."""
        reduce_type = self._reduce_type(op, factor)
        if group.size == 1:
            return CompletedWork()

        def trace(src: torch.Tensor, groups: list[list[int]]) -> torch.Tensor:
            _xm().all_reduce(reduce_type, [src], groups=groups, pin_layout=False)
            return src

        tensor.copy_(self._collective(group, tensor, trace).view(tensor.shape))
        return CompletedWork()

    @override
    def broadcast(self, tensor: torch.Tensor, src: int, group: Group, async_op: bool = False) -> Work:
        """Copy `tensor` from group rank `src` to every rank of the group, in place."""
        if group.size == 1:
            return CompletedWork()
        # Whether this rank is the source travels as device data, so every rank traces one graph;
        # where() instead of xm.collective_broadcast's multiply, which keeps NaN/inf of non-sources.
        is_src = torch.tensor(group.rank == src).to(tensor.device)

        def trace(flat: torch.Tensor, groups: list[list[int]]) -> torch.Tensor:
            mine = torch.where(is_src, flat, torch.zeros_like(flat))
            _xm().all_reduce(_xm().REDUCE_SUM, [mine], groups=groups, pin_layout=False)
            return mine

        tensor.copy_(self._collective(group, tensor, trace).view(tensor.shape))
        return CompletedWork()

    @override
    def barrier(self, group: Group) -> None:
        """Block until every rank of the group has reached this call (and its device work ran)."""
        if group.size == 1:
            return
        handle: threads.ThreadGroup = group.handle
        threads.sync_device(handle.device)
        if handle.barrier is not None:
            handle.meet()
            return
        ones = torch.ones(1, device=handle.device)
        self.all_reduce(ones, group)

    # ---- lazy-tensor specifics ------------------------------------------------------------------
    @override
    def compiler_barrier(self, tensors: Sequence[torch.Tensor]) -> None:
        """xm.optimization_barrier_: keeps XLA's CSE from fusing a gather with the free after it."""
        tensors = [t for t in tensors if t.device.type == "xla"]
        if tensors:
            _xm().optimization_barrier_(tensors)

    @override
    def step_boundary(self) -> None:
        """Cut and run this device's graph (torch_xla.sync, serialised with the other device threads)."""
        import torch_xla

        threads.sync_device(torch.device(torch_xla._XLAC._xla_get_default_device()))

    @override
    def to_host(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Host copies of `tensors`, all run as one graph first (not one compile per tensor)."""
        on_device = [t.detach() for t in tensors if t.device.type == "xla"]
        if on_device:
            threads.flush(on_device, on_device[0].device)
        return [t.detach().cpu() for t in tensors]

    @override
    def memory_stats(self, device: torch.device | None = None) -> dict[str, int]:
        """Device bytes in use and peak from xm.get_memory_info; process memory where XLA has none (CPU)."""
        try:
            info = _xm().get_memory_info(device)
            return {"allocated": int(info["bytes_used"]),
                    "peak": int(info.get("peak_bytes_used", info["bytes_used"]))}
        except Exception:  # noqa: BLE001 - the CPU client reports no memory info
            return process_memory()

    @override
    def reset_peak_memory(self, device: torch.device | None = None) -> None:
        """XLA has no peak-memory reset; nothing to do."""

    # ---- torch's own wrappers and launching ------------------------------------------------------
    @override
    def ddp_kwargs(self, device: torch.device) -> dict[str, Any]:
        """gradient_as_bucket_view=True (XLA tensors have no storage) and torch_xla's process group."""
        import torch.distributed as dist

        if self._threaded():
            raise UnsupportedOperationError(
                "DDP on XLA needs torch_xla's process group, which exists once per process, but "
                "these XLA devices are threads of one process (PJRT_DEVICE=CPU with "
                "CPU_NUM_DEVICES > 1). HINT: use shardkit.shard() here, or one device per process.")
        import torch_xla.distributed.xla_backend  # noqa: F401 - registers the "xla" backend

        if not dist.is_initialized():
            dist.init_process_group("xla", init_method="xla://")
        return {"gradient_as_bucket_view": True,
                "process_group": dist.distributed_c10d._get_default_group()}

    @override
    def spawn_ranks(self, body: Callable[..., Any], nprocs: int, args: tuple) -> list[Any] | None:
        """Run `body(rank, *args)` on `nprocs` XLA devices as torch_xla device threads."""
        from .spawn import spawn_device_threads

        return spawn_device_threads(body, nprocs, args)

    @override
    def launch_command(self, nproc_per_node: str, launcher_args: Sequence[str],
                       script_argv: Sequence[str]) -> list[str]:
        """torch_xla's launcher (torch_xla.launch, one rank per device) wrapped as a command."""
        import sys

        nproc = [] if nproc_per_node in ("", "auto") else [f"--nproc={nproc_per_node}"]
        return [sys.executable, "-m", "shardkit_backends.xla.launch", *nproc, *launcher_args,
                "--", *script_argv]
