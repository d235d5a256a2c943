"""The device + collective interface: the only thing the engine ever talks to.

A backend is made of two sides, each its own type: `DeviceSide` (placement, streams, events,
memory, host copies, launching ranks) and `CollectiveSide` (process groups, reduce ops, the
collectives). A vendor's plugin is one class, `Backend`, which is both sides at once; the engine
always reaches a side through `backend.devices` or `backend.collectives` (a lint test holds it to
that), so a pair of two vendors' sides (``backend="cuda+gloo"``, shardkit/composed.py) is just a
backend whose two attributes are two objects, with nothing forwarded, and collective-order
verification wraps the collective side alone the same way (sharding/step/verify.py).

A plugin subclasses `Backend` and fills in the seven required members (name, device_type,
is_available, requirement_hint; local_device and device_count of the device side;
process_group_backend of the collective side); everything else has a default built on stock
torch (`torch.distributed`, `torch.get_device_module`, `torch.Stream`). Defaults never name a
vendor: a backend that needs something special overrides one method. Within each side the
optional members stand in groups by who calls them, each group headed by what happens when a
plugin leaves it out. The job's rendezvous is not the backend's: init() joins the job's store
(job/rendezvous.py) and hands it over in LaunchEnv.store. Ranks per machine come from
max_local_ranks(): one per device by default, None (unlimited) where ranks share a host.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import resource
from typing import Any, ClassVar, Sequence

import torch
from typing_extensions import override

from .capabilities import AttentionCall, Capabilities
from .errors import ShardkitError, UnsupportedOperationError
from .handles import CompletedWork, Group, NullEvent, NullStream, ReduceOp, TorchWork, Work
from .launch_env import LaunchEnv, detect_launch_env

API_VERSION = 1

DeviceLike = torch.device | str | int | None


class DeviceSide:
    """The device half of a backend: where tensors live, streams, events, memory, host copies, launching ranks."""

    # The class facts a side reads (Backend sets them; see there).
    name: ClassVar[str]
    device_type: ClassVar[str]
    capabilities: ClassVar[Capabilities]

    # ==== required: what every plugin writes
    def local_device(self, local_rank: int) -> torch.device:
        """Return the fully indexed device this local rank computes on."""
        raise NotImplementedError

    def device_count(self) -> int:
        """Return how many devices of this type this process can see."""
        raise NotImplementedError

    # ==== joining the job: runtime.init(), spawn, `shardkit launch`
    # Left out: torchrun-style environment variables, the device made current through
    # torch.get_device_module, torchrun as the launcher.
    def launch_env(self) -> LaunchEnv:
        """Return this process's place in the job (backends whose ranks are threads override)."""
        return detect_launch_env()

    def normalize_device(self, device_id: DeviceLike, local_rank: int) -> torch.device:
        """Turn None, an int, "type", "type:i" or a torch.device into this backend's indexed device."""
        if device_id is None:
            return self.local_device(local_rank)
        if isinstance(device_id, bool) or not isinstance(device_id, (int, str, torch.device)):
            raise ShardkitError(f"device_id must be None, an int, a string or a torch.device, "
                                f"got {type(device_id).__name__}")
        if isinstance(device_id, int):
            if device_id < 0:
                raise ShardkitError(f"device_id {device_id} is negative; pass a device index >= 0")
            return self.indexed_device(device_id)
        dev = torch.device(device_id)
        if dev.type != self.device_type:
            raise ShardkitError(
                f"device_id {str(dev)!r} is a {dev.type!r} device but the {self.name!r} backend runs "
                f"on {self.device_type!r}; pass a {self.device_type} device or choose the backend "
                f"for {dev.type!r} with backend=...")
        if dev.index is None:
            return self.local_device(local_rank)
        return self.indexed_device(dev.index)

    def indexed_device(self, index: int) -> torch.device:
        """Return device `index` of this type, refusing an index past device_count() (normalize_device calls it)."""
        count = self.device_count()
        if count and index >= count:
            raise ShardkitError(f"device index {index} is out of range: this process sees {count} "
                                f"{self.device_type} device(s)")
        return torch.device(self.device_type, index)

    def set_device(self, device: torch.device) -> None:
        """Make `device` the current device of this process (a no-op where that means nothing)."""
        module = self.device_module()
        if device.index is not None and hasattr(module, "set_device"):
            module.set_device(device)

    def spawn_ranks(self, body: Any, nprocs: int, args: tuple) -> list[Any] | None:
        """Run ``body(rank, *args)`` on `nprocs` local ranks the backend's own way, or return None for processes."""
        return None

    def launch_command(self, nproc_per_node: str, launcher_args: Sequence[str],
                       script_argv: Sequence[str]) -> list[str]:
        """Return the command `shardkit launch` runs: torchrun by default; a backend with its own launcher overrides this."""
        import sys

        # torchrun's agent (torch.distributed.run, through shardkit.cli.launch_agent, which says a
        # failure in a few lines instead of torchrun's traceback) starts the ranks and sets RANK,
        # WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT, which shardkit.init() reads; launcher_args
        # are torchrun options. "--" stops torchrun's parser from reading the script's own options
        # (it rejects a script's "--nproc" as an ambiguous abbreviation of its --nproc-per-node).
        return [sys.executable, "-m", "shardkit.cli.launch_agent", f"--nproc-per-node={nproc_per_node}",
                *launcher_args, "--", *script_argv]

    # ==== device operations: the engine, every step (sharding/step/)
    # Left out: torch's generic stream, event and memory calls for the device type, or null
    # streams and events where capabilities.has_streams is False; storage resized in place where
    # capabilities.supports_storage_resize; no compiler barrier or step boundary.
    def device_module(self) -> Any:
        """Return the torch module for this device type (``torch.get_device_module``); the stream, memory and sync defaults call it."""
        return torch.get_device_module(self.device_type)

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        """Return True when parameters and collectives of this dtype work on this backend."""
        return dtype in self.capabilities.supported_dtypes

    def runs_fused_attention(self, call: AttentionCall) -> bool:
        """Whether scaled_dot_product_attention runs a fused kernel here for `call` (the planner's
        meta simulation then keeps its output and log-sum-exp, not the math path's scores).

        The answer is the declared static fact, `capabilities.fused_attention` (torch's CPU kernel
        unless the backend declares another); the planner reads that without starting the backend."""
        return self.capabilities.fused_attention(call)

    def host_device(self) -> torch.device:
        """Where cpu_offload keeps shards, gradients and optimizer state: the host's memory."""
        return torch.device("cpu")

    def new_stream(self, device: torch.device) -> Any:
        """Return a new stream on `device`, or a NullStream."""
        if not self.capabilities.has_streams:
            return NullStream()
        return torch.Stream(device=device)

    def current_stream(self, device: torch.device) -> Any:
        """Return the stream compute currently runs on, or a NullStream."""
        if not self.capabilities.has_streams:
            return NullStream()
        return self.device_module().current_stream(device)

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        """Return a context manager under which work is queued on `stream`."""
        if isinstance(stream, NullStream):
            return contextlib.nullcontext(stream)
        return self.device_module().stream(stream)

    def new_event(self) -> Any:
        """Return a new event, or a NullEvent."""
        if not self.capabilities.has_streams:
            return NullEvent()
        return torch.Event(device=self.device_type)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tell the caching allocator `tensor` is in use on `stream` (streams only)."""
        if self.capabilities.has_streams and not isinstance(stream, NullStream):
            tensor.record_stream(stream)

    def synchronize(self, device: torch.device | None = None) -> None:
        """Wait until all queued work on the device has finished."""
        module = self.device_module()
        if hasattr(module, "synchronize"):
            module.synchronize(device) if device is not None and device.index is not None else module.synchronize()

    def free_storage(self, tensor: torch.Tensor) -> None:
        """Release a tensor's memory while keeping the tensor object (and autograd's view of it)."""
        if not self.capabilities.supports_storage_resize:
            raise UnsupportedOperationError(
                f"backend {self.name!r} cannot free tensor storage; the engine replaces the tensor")
        storage = tensor.untyped_storage()
        if storage.size() != 0:
            storage.resize_(0)

    def alloc_storage(self, tensor: torch.Tensor) -> None:
        """Give back a freed tensor the storage its shape needs."""
        if not self.capabilities.supports_storage_resize:
            raise UnsupportedOperationError(
                f"backend {self.name!r} cannot resize tensor storage; the engine replaces the tensor")
        nbytes = tensor.numel() * tensor.element_size()
        storage = tensor.untyped_storage()
        if storage.size() != nbytes:
            storage.resize_(nbytes)

    def compiler_barrier(self, tensors: Sequence[torch.Tensor]) -> None:
        """Stop a graph compiler from moving work across this point (no-op for eager devices)."""

    def step_boundary(self) -> None:
        """Mark the end of a training step after optimizer.step() (graph cut on lazy devices)."""

    # ==== host copies and memory figures: checkpoints, the demo, users timing phases
    # Left out: detach().cpu() copies (pinned, one sync, where the device has streams) and the
    # device module's memory counters, else the process's resident memory.
    def to_host(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of `tensors` in host memory (lazy devices run all of them as one graph first)."""
        return [t.detach().cpu() for t in tensors]

    def snapshot_to_host(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Host copies of `tensors` that later in-place updates on the device leave unchanged."""
        if self.capabilities.has_streams and any(t.device.type != "cpu" for t in tensors):
            # Pinned staging: the device-to-host copies queue together and one sync waits for all.
            staged = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for dst, src in zip(staged, tensors):
                dst.copy_(src.detach(), non_blocking=True)
            self.synchronize(next(t.device for t in tensors if t.device.type != "cpu"))
            return staged
        hosted = self.to_host(tensors)
        # On the host, to_host may hand back the tensor itself; the optimizer would then change it.
        # (Device tensors may have no storage to ask about: XLA's; their host copy is new anyway.)
        return [h.clone() if t.device.type == "cpu"
                and h.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
                else h for h, t in zip(hosted, tensors)]

    def memory_stats(self, device: torch.device | None = None) -> dict[str, int]:
        """Return current and peak memory in bytes: {"allocated": .., "peak": ..} (the demo's memory report)."""
        module = self.device_module()
        if hasattr(module, "max_memory_allocated"):
            return {"allocated": int(module.memory_allocated(device)),
                    "peak": int(module.max_memory_allocated(device))}
        return process_memory()

    def reset_peak_memory(self, device: torch.device | None = None) -> None:
        """Start a new peak-memory window where the device allows it (for users timing phases; the engine never calls it)."""
        module = self.device_module()
        if hasattr(module, "reset_peak_memory_stats"):
            module.reset_peak_memory_stats(device)

    # ==== torch's own wrappers: replicate() and DDP
    # Left out: DDP gets no extra keyword arguments.
    def ddp_kwargs(self, device: torch.device) -> dict[str, Any]:
        """Keyword arguments DistributedDataParallel needs on this backend."""
        return {}


class CollectiveSide:
    """The collective half of a backend: process groups, reduce ops and the collectives on them."""

    # The class facts a side reads (Backend sets them; see there).
    name: ClassVar[str]
    device_type: ClassVar[str]
    capabilities: ClassVar[Capabilities]

    # ==== required: what every plugin writes
    def process_group_backend(self) -> str:
        """Return the torch.distributed backend string, e.g. "gloo"."""
        raise NotImplementedError

    # ==== joining the job: runtime.init() and shutdown
    # Left out: a torch.distributed default group on the job's store.
    def process_group_options(self, env: LaunchEnv) -> dict[str, Any]:
        """Extra keyword arguments for init_process_group: the one place a device_id policy lives."""
        return {}

    def init_process_group(self, env: LaunchEnv, timeout: datetime.timedelta) -> Group:
        """Join (or create) the default process group for this job and return the world group."""
        import torch.distributed as dist

        if dist.is_initialized():
            return self.world_group()
        options = dict(backend=self.process_group_backend(), rank=env.rank,
                       world_size=env.world_size, timeout=timeout,
                       **self.process_group_options(env))
        if env.master_port is None:
            # A lone process: an in-memory store, so no port is opened and nothing can collide.
            dist.init_process_group(store=dist.HashStore(), **options)
        else:
            if env.store is None:
                raise ShardkitError(
                    f"rank {env.rank} of {env.world_size} has no job store to make its process "
                    "group with: shardkit.init() joins it (rendezvous.with_job_store) before "
                    "calling init_process_group. HINT: call shardkit.init(), or pass "
                    "dataclasses.replace(env, store=...) when calling a backend directly")
            # The prefix is the one torch gives its default group's keys on the env:// path.
            dist.init_process_group(store=dist.PrefixStore("default_pg", env.store), **options)
        return self.world_group()

    def world_group(self) -> Group:
        """Return the group of all ranks in the job."""
        import torch.distributed as dist

        size = dist.get_world_size()
        return Group(dist.get_rank(), size, tuple(range(size)), dist.group.WORLD)

    def shutdown(self) -> None:
        """Destroy the process group this backend created."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    # ==== collectives: the engine, checkpoints, replica checks
    # Left out: torch.distributed's collectives on the groups this backend made (a one-rank group
    # copies locally); averaging by sum and divide unless capabilities.exact_reduce_ops names an
    # exact op.
    def new_group(self, ranks: Sequence[int]) -> Group:
        """Create a subgroup; every rank of the job must call this with the same ranks."""
        import torch.distributed as dist

        # torch orders a group by ascending global rank whatever order it is given; so do we,
        # or Group.rank and Group.ranks would disagree with where collectives put each slice.
        ranks = tuple(sorted(int(r) for r in ranks))
        handle = dist.new_group(list(ranks))
        me = dist.get_rank()
        return Group(ranks.index(me) if me in ranks else -1, len(ranks), ranks, handle)

    def destroy_group(self, group: Group) -> None:
        """Destroy a subgroup new_group made, on this rank alone (no peer takes part).

        shard() calls it when the model whose groups these are is collected. The default destroys
        a torch.distributed group; a handle torch does not know (already destroyed by shutdown(),
        or a backend's own object) is left alone. The world group is never passed here.
        """
        import torch.distributed as dist

        handle = group.handle
        if handle is None or not dist.is_initialized() or handle == dist.GroupMember.WORLD:
            return
        try:
            dist.destroy_process_group(handle)
        except ValueError:  # "Invalid process group specified": not (or no longer) torch's
            pass

    def exact_reduce_ops_for(self, dtype: torch.dtype) -> frozenset[str]:
        """The exact averaging ops (Capabilities.exact_reduce_ops) that hold for `dtype` here; a backend narrows them by library version or dtype."""
        return self.capabilities.exact_reduce_ops

    def torch_reduce_op(self, op: str, factor: float | None = None) -> Any:
        """Return torch.distributed's reduce op for `op` ("premul_sum" needs a backend override: torch builds it per vendor)."""
        import torch.distributed as dist

        check_reduce_op(self, op, factor)
        if op == ReduceOp.PREMUL_SUM:
            raise UnsupportedOperationError(
                f"backend {self.name!r} declares 'premul_sum' exact but does not build it; "
                "HINT: override torch_reduce_op() to return the library's pre-scaled sum op")
        return {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MAX: dist.ReduceOp.MAX,
                ReduceOp.MIN: dist.ReduceOp.MIN, ReduceOp.AVG: dist.ReduceOp.AVG}[op]

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, group: Group,
                               async_op: bool = False) -> Work:
        """Concatenate every rank's `input` into `output` (rank order, along dim 0)."""
        import torch.distributed as dist

        check_flat_sizes("all_gather_into_tensor", "output", output, "input", input, group)
        if group.size == 1:
            return copy_locally(output, input)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return TorchWork(gather(output, input, group=group.handle, async_op=async_op))

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, group: Group,
                          async_op: bool = False) -> Work:
        """Send the i-th of `input`'s equal slices to group rank i; `output`'s i-th slice receives rank i's slice for this rank.

        The engine's quantized reductions (sharding/step/quantize.py) move int8 payloads with it,
        so a library that cannot sum int8 blocks correctly never has to.
        """
        import torch.distributed as dist

        check_equal_split("all_to_all_single", output, input, group)
        if group.size == 1:
            return copy_locally(output, input)
        return TorchWork(dist.all_to_all_single(output, input, group=group.handle,
                                                async_op=async_op))

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, group: Group,
                              op: str = ReduceOp.SUM, async_op: bool = False, *,
                              factor: float | None = None) -> Work:
        """Reduce `input` across ranks and leave this rank's equal slice in `output` ("premul_sum": each input scaled by `factor` first).

        `input` is consumed: the engine passes scratch (a packed buffer or a dead gradient) and
        never reads it afterwards, so a backend may reduce in place; its contents afterwards are
        unspecified.
        """
        import torch.distributed as dist

        torch_op = self.torch_reduce_op(op, factor)
        # gloo aborts the whole process on a size mismatch in some torch versions: refuse it first.
        check_flat_sizes("reduce_scatter_tensor", "input", input, "output", output, group)
        if group.size == 1:
            return scale_locally(copy_locally(output, input), output, factor)
        # torch >= 2.12 renamed these (the old names warn); 2.9-2.11 have only the old ones.
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return TorchWork(scatter(output, input, op=torch_op, group=group.handle, async_op=async_op))

    def all_reduce(self, tensor: torch.Tensor, group: Group, op: str = ReduceOp.SUM,
                   async_op: bool = False, *, factor: float | None = None) -> Work:
        """Reduce `tensor` across ranks in place ("premul_sum": each input scaled by `factor` first)."""
        import torch.distributed as dist

        torch_op = self.torch_reduce_op(op, factor)
        if group.size == 1:
            return scale_locally(CompletedWork(), tensor, factor)
        return TorchWork(dist.all_reduce(tensor, op=torch_op, group=group.handle, async_op=async_op))

    def broadcast(self, tensor: torch.Tensor, src: int, group: Group, async_op: bool = False) -> Work:
        """Copy `tensor` from group rank `src` to every rank of the group, in place."""
        import torch.distributed as dist

        if group.size == 1:
            return CompletedWork()
        return TorchWork(dist.broadcast(tensor, src=group.ranks[src], group=group.handle,
                                        async_op=async_op))

    def barrier(self, group: Group) -> None:
        """Block until every rank of the group has reached this call."""
        import torch.distributed as dist

        if group.size > 1:
            dist.barrier(group=group.handle)

    # Left out: no torchft process group, so shard(..., fault_tolerance=...) is refused.
    def fault_tolerant_process_group(self, timeout: datetime.timedelta) -> Any:
        """A torchft process group for the all-reduce across replica groups (reconfigured per quorum)."""
        raise UnsupportedOperationError(
            f"backend {self.name!r} names no torchft process group, so its replica groups cannot "
            "be made fault tolerant; HINT: run on a backend that does (the built-in cpu, cuda "
            "and xpu backends do), or override fault_tolerant_process_group() in the backend plugin")


class Backend(DeviceSide, CollectiveSide):
    """Base class of every backend: its class facts, and both sides in one object (`devices` and `collectives` are itself)."""

    # ==== required: what every plugin writes (and local_device, device_count, process_group_backend)
    name: ClassVar[str]  # what users pass as backend=..., e.g. "cpu"
    device_type: ClassVar[str]  # torch device type, e.g. "cpu"

    @classmethod
    def is_available(cls) -> bool:
        """Return True when this backend can run here. Must never raise or touch a device."""
        raise NotImplementedError

    @classmethod
    def requirement_hint(cls) -> str:
        """Return what a user should do to make this backend available (the pip extra)."""
        raise NotImplementedError

    # ==== class facts: read off the class, never started (selection, `shardkit info`, planner)
    # Left out: the defaults below; the planner plans with the default Capabilities.
    priority: ClassVar[int] = 0  # auto-detection order: higher wins among available backends
    auto_select: ClassVar[bool] = True  # False: only chosen by name (or when auto_select_now())
    requires_api: ClassVar[int] = API_VERSION
    capabilities: ClassVar[Capabilities] = Capabilities()
    # Names of the collective library this backend's collective side is, for pairing it with
    # another backend's device as "DEVICE+LIBRARY" (shardkit/composed.py), e.g. ("gloo",).
    collective_libraries: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def unavailable_reason(cls) -> str:
        """Return why is_available() is False, in words a user can act on."""
        return "is_available() returned False"

    @classmethod
    def auto_select_now(cls) -> bool:
        """Return True when auto-detection may pick this backend in the current environment."""
        return cls.auto_select

    @classmethod
    def versions(cls) -> dict[str, str]:
        """Return the versions of the vendor packages this backend relies on."""
        return {}

    @override
    def __repr__(self) -> str:
        return f"<shardkit backend {self.name!r} device_type={self.device_type!r}>"

    # ==== the two sides, as the engine reaches them
    @property
    def devices(self) -> DeviceSide:
        """The side that places tensors and runs the device (this backend itself; a pair's device backend)."""
        return self

    @property
    def collectives(self) -> CollectiveSide:
        """The side that makes groups and runs collectives (this backend itself; a pair's collective backend)."""
        return self

    # Left out: one rank per device.
    def max_local_ranks(self) -> int | None:
        """Return how many ranks one machine can run: one per device by default; None for as many as asked."""
        return self.device_count()



def side_members(side: type[DeviceSide] | type[CollectiveSide]) -> tuple[str, ...]:
    """The public methods a side declares: what the engine may call through `backend.devices` or `backend.collectives`."""
    return tuple(name for name, value in vars(side).items()
                 if callable(value) and not name.startswith("_"))


def process_memory() -> dict[str, int]:
    """Return this process's resident and peak resident memory in bytes (Linux and macOS)."""
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = peak_kb if os.uname().sysname == "Darwin" else peak_kb * 1024
    try:
        with open("/proc/self/statm") as f:
            current = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        current = peak
    # The kernel sums its RSS counters per CPU lazily, so the two reads can differ by a few pages
    # either way; a peak below the current value is never the truth.
    return {"allocated": current, "peak": max(peak, current)}


def check_flat_sizes(op: str, whole_name: str, whole: torch.Tensor, part_name: str,
                     part: torch.Tensor, group: Group) -> None:
    """Raise a ShardkitError unless `whole` holds exactly one `part` per rank of `group`."""
    if whole.numel() != part.numel() * group.size:
        raise ShardkitError(f"{op} needs {whole_name}.numel() == {part_name}.numel() * group size, "
                            f"got {whole.numel()} vs {part.numel()} x {group.size}")


def check_equal_split(op: str, output: torch.Tensor, input: torch.Tensor, group: Group) -> None:
    """Raise a ShardkitError unless `output` and `input` are the same size, a multiple of the group's."""
    if output.numel() != input.numel() or input.numel() % group.size:
        raise ShardkitError(f"{op} needs output and input of one size that splits evenly over "
                            f"the group's {group.size} ranks, got {output.numel()} and "
                            f"{input.numel()}")


def check_reduce_op(backend: CollectiveSide, op: str, factor: float | None) -> None:
    """Raise UnsupportedOperationError unless `backend` accepts `op`, with a factor exactly for "premul_sum"."""
    caps = backend.capabilities
    accepted = caps.reduce_ops | caps.exact_reduce_ops
    if op not in accepted:
        raise UnsupportedOperationError(
            f"backend {backend.name!r} does not support reduce op {op!r}; it supports "
            f"{sorted(accepted)}. For a mean, reduce with 'sum' and divide.")
    if (factor is not None) != (op == ReduceOp.PREMUL_SUM):
        raise ShardkitError(f"reduce op {op!r} with factor={factor!r}: 'premul_sum' needs a "
                            "factor and no other op takes one")


def scale_locally(work: Work, tensor: torch.Tensor, factor: float | None) -> Work:
    """The pre-scaling a one-rank "premul_sum" still owes its result (nothing for other ops)."""
    if factor is not None:
        tensor.mul_(factor)
    return work


def copy_locally(output: torch.Tensor, input: torch.Tensor) -> Work:
    """The gather or reduce-scatter of a one-rank group: a copy, already complete."""
    output.copy_(input.reshape(output.shape))
    return CompletedWork()


def check_local_ranks(backend: Backend, nprocs: int) -> None:
    """Refuse, before any rank starts, more ranks on this machine than the backend has devices for."""
    limit = backend.max_local_ranks()
    if limit is None or nprocs <= limit:
        return
    raise ShardkitError(
        f"{nprocs} local ranks were asked for, but the {backend.name!r} backend sees {limit} "
        f"{backend.device_type} device(s) on this machine and each rank needs its own.\n"
        f"HINT: pass {max(limit, 1)} or fewer (`--nproc {max(limit, 1)}`, or nprocs={max(limit, 1)} "
        "for shardkit.spawn), or run the ranks as host processes with `--backend cpu`.")
