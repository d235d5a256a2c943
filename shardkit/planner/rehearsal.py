"""The planner's step: the real engine rehearsing a training step on the meta device.

A planner that describes the engine by hand (when it gathers, what it keeps, which buffers it
pools) drifts from it with every change to the engine, and errs low where it forgot something:
the CPU buffer pool kept between steps was one such miss. So the planner does not describe the
engine: `shardkit.shard()` itself shards a meta-device copy of the model under a backend that
moves no bytes (`RehearsalBackend`: the target backend's capabilities, so the engine takes the
target's code paths, with collectives that return at once and storage changes reported to the
tracker), the user's kind of optimizer steps it, and two training steps run. Every tensor the
second step allocates and frees is recorded (`LiveBytes`): the model's activations, the engine's
gathered parameters, buffers, pooled buffers and gradient shards, the optimizer's state and its
temporaries. A change to the engine's schedule changes the plan with no edit here.

The rehearsal is rank 0 of `world_size` ranks (the fullest: padding goes to the last ranks).
Beside tensor parallelism (plan(tp=)) the meta copy is first parallelized with the user's TP plan
on a mesh of torch's fake process groups (tensor_parallel.py) and sharded on its data-parallel
dimension(s), as the training script would shard it; the step runs under loss_parallel, and
TP's own collectives are counted as it issues them.
Under cpu_offload the host's tensors are meta tensors too (Backend.host_device); those alive at
the end of the step (shards, gradients, optimizer state) are left out of the device's count.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from typing_extensions import override

from ..backend import Backend
from ..capabilities import Capabilities
from ..errors import ShardkitError
from ..handles import CompletedWork, Group, NullEvent, NullStream, Work
from ..launch_env import LaunchEnv
from ..logs import logger
from .activations import (FusedAttention, InputsFn, LiveBytes, model_loss, token_inputs,
                          traceable_on_meta, with_fused_attention)
from .replay import StepRecord
from .tensor_parallel import (TensorParallel, TensorParallelTraffic, data_parallel_mesh,
                              data_parallel_shape, fake_world, parallelized)

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "adadelta": torch.optim.Adadelta,
    "sgd": lambda params, **kw: torch.optim.SGD(params, lr=0.01, **kw)}


class RehearsalBackend(Backend):
    """A backend on the meta device whose collectives move nothing: the engine's paths are the
    target's (its capabilities), every byte it allocates is a meta tensor the tracker counts."""

    name = "rehearsal"
    device_type = "meta"

    def __init__(self, target: Capabilities, world_size: int, fake_groups: bool = False) -> None:
        # Per instance, not per class: each plan rehearses its own target. With fake_groups the
        # parameters are DTensors on a mesh of torch's fake process groups (a TP rehearsal:
        # tensor_parallel.py); the engine's own collectives still come here and move nothing.
        self.capabilities = dataclasses.replace(  # type: ignore[misc]
            target, torch_process_group=fake_groups, holds_values=False)
        self.world_size = world_size
        self.tracker: LiveBytes | None = None
        # The tensors collectives took: the tracker's allocation number -> (bytes, storage).
        # Keyed by allocation, not address: a freed storage's address is reused.
        self._collective_tensors: dict[int, tuple[int, int]] = {}

    @classmethod
    @override
    def is_available(cls) -> bool:
        """Always: it needs nothing but torch."""
        return True

    @classmethod
    @override
    def requirement_hint(cls) -> str:
        """Nothing to install."""
        return ""

    @override
    def local_device(self, local_rank: int) -> torch.device:
        """The meta device, for every rank."""
        return torch.device("meta")

    @override
    def device_count(self) -> int:
        """As many devices as rehearsed ranks."""
        return self.world_size

    @override
    def process_group_backend(self) -> str:
        """torch's fake process groups where a TP rehearsal's mesh has them, else none."""
        return "fake" if self.capabilities.torch_process_group else "none"

    @override
    def normalize_device(self, device_id: Any, local_rank: int) -> torch.device:
        """The meta device, whatever was asked."""
        return torch.device("meta")

    @override
    def set_device(self, device: torch.device) -> None:
        """Nothing to select."""

    @override
    def host_device(self) -> torch.device:
        """The meta device: offloaded tensors cost no host memory while planning."""
        return torch.device("meta")

    @override
    def new_stream(self, device: torch.device) -> Any:
        """A null stream (meta work is not queued)."""
        return NullStream()

    @override
    def current_stream(self, device: torch.device) -> Any:
        """A null stream."""
        return NullStream()

    @override
    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        """A context that changes nothing."""
        return contextlib.nullcontext(stream)

    @override
    def new_event(self) -> Any:
        """A null event."""
        return NullEvent()

    @override
    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """Nothing to tell an allocator."""

    @override
    def synchronize(self, device: torch.device | None = None) -> None:
        """Nothing to wait for."""

    @override
    def free_storage(self, tensor: torch.Tensor) -> None:
        """Free the storage in place and tell the tracker (a resize is no op it sees)."""
        storage = tensor.untyped_storage()
        number = self.tracker.allocation_of(storage._cdata) if self.tracker is not None else None
        if number is not None:
            # Freed in place: a library that holds the tensor longer holds no memory.
            self._collective_tensors.pop(number, None)
        if storage.size() != 0:
            storage.resize_(0)
            if self.tracker is not None:
                self.tracker.resized(storage)

    @override
    def alloc_storage(self, tensor: torch.Tensor) -> None:
        """Give the storage its bytes back and tell the tracker."""
        nbytes = tensor.numel() * tensor.element_size()
        storage = tensor.untyped_storage()
        if storage.size() != nbytes:
            storage.resize_(nbytes)
            if self.tracker is not None:
                self.tracker.resized(storage)

    @override
    def new_group(self, ranks: Sequence[int]) -> Group:
        """A group as rank 0 sees it; nothing is created."""
        ranks = tuple(sorted(int(r) for r in ranks))
        return Group(ranks.index(0) if 0 in ranks else -1, len(ranks), ranks)

    @override
    def destroy_group(self, group: Group) -> None:
        """Nothing was created."""

    @override
    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, group: Group,
                               async_op: bool = False) -> Work:
        """Done at once; the output's size is noted (a quantized gather's payload is let go
        after decoding, and the library may hold it a while longer)."""
        self._note_collective(output)
        return CompletedWork()

    @override
    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, group: Group,
                              op: str = "sum", async_op: bool = False, *,
                              factor: float | None = None) -> Work:
        """Done at once; the input's size is noted (a library may hold it a while longer)."""
        self._note_collective(input)
        return CompletedWork()

    @override
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, group: Group,
                          async_op: bool = False) -> Work:
        """Done at once; the sizes of both buffers are noted (a quantized reduction's payloads,
        sent and received, held by one library handle and let go together)."""
        self._note_collective(input, also=output)
        return CompletedWork()

    @override
    def all_reduce(self, tensor: torch.Tensor, group: Group, op: str = "sum",
                   async_op: bool = False, *, factor: float | None = None) -> Work:
        """Done at once; the tensor's size is noted."""
        self._note_collective(tensor)
        return CompletedWork()

    def _note_collective(self, tensor: torch.Tensor, also: torch.Tensor | None = None) -> None:
        key = tensor.untyped_storage()._cdata
        number = self.tracker.allocation_of(key) if self.tracker is not None else None
        if number is not None:
            nbytes = tensor.numel() * tensor.element_size()
            if also is not None:  # a second buffer the same library handle holds
                nbytes += also.numel() * also.element_size()
            self._collective_tensors[number] = (nbytes, key)

    def largest_let_go(self) -> int:
        """The largest tensor of a collective that the engine let go of (its last reference
        dropped, not freed in place and not kept in its buffer pool): what a library thread that
        releases tensors late could still hold."""
        assert self.tracker is not None
        return max((nbytes for number, (nbytes, key) in self._collective_tensors.items()
                    if self.tracker.allocation_of(key) != number), default=0)

    @override
    def broadcast(self, tensor: torch.Tensor, src: int, group: Group, async_op: bool = False) -> Work:
        """Done at once."""
        return CompletedWork()

    @override
    def barrier(self, group: Group) -> None:
        """No peers to wait for."""


@dataclasses.dataclass(frozen=True)
class Rehearsal:
    """What one rehearsed configuration tells the planner."""

    record: StepRecord  # the second step's device allocations and frees, what was live first
    comm: dict[str, int]  # the engine's CommStats of that step, as comm_stats(model) says them
    tp_comm: dict[str, Any] | None = None  # tensor parallelism's collectives in that step


@dataclasses.dataclass(frozen=True)
class StepSetup:
    """Everything shard() and the training loop take, for one rehearsed configuration."""

    world_size: int
    shard_kwargs: dict[str, Any]  # strategy, auto_wrap_policy, mixed_precision, cpu_offload, ...
    optimizer: str
    target: Capabilities
    target_device_type: str  # decides the optimizer's foreach path, as torch decides it
    checkpoint_classes: tuple[type, ...]  # activation checkpointing on these layers, or ()
    threads: int = 1  # intra-op threads per rank (kernel workspaces per thread)
    tensor_parallel: TensorParallel | None = None  # TP inside, on a fake mesh (tensor_parallel.py)


def rehearse(model: nn.Module, setup: StepSetup, batch: int, seq: int,
             inputs: InputsFn | None) -> Rehearsal:
    """Shard a meta copy of `model` as `setup` says, train two steps, record the second."""
    tp = setup.tensor_parallel
    if tp is None:
        with torch.device("meta"):
            twin = copy.deepcopy(model).to("meta")  # hooks, casts and checkpointing stay off `model`
        return _rehearse(model, twin, setup, batch, seq, inputs)
    options = setup.shard_kwargs
    dp_shape = data_parallel_shape(options["strategy"], setup.world_size // tp.size,
                                   options.get("hybrid_group_size"))
    with fake_world(setup.world_size, dp_shape, tp.size) as mesh:
        twin = parallelized(model, tp, mesh)
        setup = dataclasses.replace(setup, shard_kwargs={**setup.shard_kwargs,
                                                         "mesh": data_parallel_mesh(mesh)})
        return _rehearse(model, twin, setup, batch, seq, inputs)


def _rehearse(model: nn.Module, twin: nn.Module, setup: StepSetup, batch: int, seq: int,
              inputs: InputsFn | None) -> Rehearsal:
    from ..job.runtime import DistContext, acting_context
    from ..sharding.api import shard
    from ..sharding.surface.recipes import checkpoint_layers
    from ..sharding import comm_stats

    tp = setup.tensor_parallel
    backend = RehearsalBackend(setup.target, setup.world_size, fake_groups=tp is not None)
    world = Group(0, setup.world_size, tuple(range(setup.world_size)))
    env = LaunchEnv(0, setup.world_size, 0, setup.world_size, "127.0.0.1", None, "planner")
    context = DistContext(backend, env, torch.device("meta"), world)
    make_inputs = inputs or token_inputs(twin)
    traffic = TensorParallelTraffic() if tp is not None else None
    tracker = LiveBytes(workspace=setup.target.kernel_workspace, threads=setup.threads)
    backend.tracker = tracker
    runs_fused = setup.target.fused_attention
    # Python's cycle collector would free cyclic garbage at moments that depend on everything
    # allocated before: the same rehearsal would record different events. Off for the step,
    # cyclic garbage lives to its end (counted, so the plan errs high, never low).
    collecting = gc.isenabled()
    gc.disable()
    try:
        with acting_context(context), _quiet(), tracker, FusedAttention(runs_fused), \
                traceable_on_meta():
            twin = shard(twin, **setup.shard_kwargs)
            if setup.checkpoint_classes:
                # Recomputation runs on autograd's thread, where the modes above are not active.
                for layer in twin.modules():
                    if isinstance(layer, setup.checkpoint_classes):
                        layer.forward = with_fused_attention(layer.forward, runs_fused)
                checkpoint_layers(twin, setup.checkpoint_classes)
            optimizer = _optimizer(setup, twin)
            args, kwargs = make_inputs(batch, seq)  # the batch is on the device during the step
            with _sharded_loss(tp is not None):
                _train_step(twin, optimizer, args, kwargs)
            comm_stats(twin, reset=True)  # the second step's traffic only
            tracker.begin_window()
            with _sharded_loss(tp is not None), traffic or contextlib.nullcontext():
                _train_step(twin, optimizer, args, kwargs, zero_grad=False)
            host = _host_storages(twin, optimizer) if setup.shard_kwargs.get("cpu_offload") else set()
            # A library that releases a finished collective's tensors late (Capabilities.
            # collective_tensors_linger) may hold the largest one into any moment of the step.
            linger = 0
            if setup.target.collective_tensors_linger:
                # TP's collectives too: a real library holds its buffers to the wait (gloo's
                # reduce-scatter keeps a copy of its whole input), which the fake groups, done
                # at once, never do; measured as the 2.2 % a TP x activation-checkpointing
                # rehearsal was under a real run before this was added.
                linger = backend.largest_let_go() + (traffic.largest_input if traffic else 0)
            record = StepRecord(batch, tracker.window_events(leave_out=host), linger)
            comm = comm_stats(twin)
            optimizer.zero_grad()
        del twin, optimizer  # the rehearsal's model is freed here, with its engine state
    except ShardkitError:
        raise
    except Exception as exc:
        raise ShardkitError(
            f"rehearsing a training step of {type(model).__name__} on the meta device failed "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). A forward "
            "that reads tensor values (data-dependent control flow) cannot run there. HINT: plan "
            "without batch= (the peak then leaves activations out), or pass "
            "example_inputs=fn(batch, seq) returning (args, kwargs) that the forward accepts"
        ) from exc
    finally:
        if collecting:
            gc.enable()
    return Rehearsal(record, comm, traffic.snapshot() if traffic is not None else None)


def _sharded_loss(tensor_parallel: bool) -> contextlib.AbstractContextManager:
    """torch's loss_parallel under TP: logits a TP plan leaves sharded over the vocabulary (its
    output layer's Shard(-1)) are taken as torchtitan's loop takes them, without a gather."""
    if not tensor_parallel:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict,
                zero_grad: bool = True) -> None:
    model_loss(model(*args, **kwargs)).backward()
    optimizer.step()
    if zero_grad:
        optimizer.zero_grad()


def _optimizer(setup: StepSetup, model: nn.Module) -> torch.optim.Optimizer:
    from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

    make = OPTIMIZERS.get(setup.optimizer.lower())
    if make is None:
        raise ShardkitError(f"unknown optimizer {setup.optimizer!r}; choose one of "
                            f"{', '.join(sorted(OPTIMIZERS))}")
    # torch picks the multi-tensor (foreach) path on devices with those kernels, and it keeps
    # temporaries the size of every parameter at once: take the path the target device takes.
    foreach = setup.target_device_type in _get_foreach_kernels_supported_devices()
    return make([p for p in model.parameters() if p.requires_grad], foreach=foreach)


def _host_storages(model: nn.Module, optimizer: torch.optim.Optimizer) -> set[int]:
    """The storages cpu_offload keeps on the host: shards, their gradients, optimizer state."""
    tensors: list[torch.Tensor] = []
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        tensors.append(local)
        if p.grad is not None:
            tensors.append(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad)
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return {t.untyped_storage()._cdata for t in tensors}


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No "rank 0: sharded ..." lines from a rehearsal in the user's log."""
    previous = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = previous

