"""A training step's memory high-water mark, found by running the step on the meta device.

Activations are the largest term of a transformer's peak and depend on everything the step does
(attention layout, the loss, which ops save what), so they are not estimated from a formula: the
model's forward and backward run on the meta device, where ops compute shapes and nothing is
allocated, and every tensor an op creates is tracked until its storage dies (``LiveBytes``).
On meta, `scaled_dot_product_attention` would fall back to its math path and keep the
(seq x seq) scores; on CPU and GPU torch runs a fused kernel that keeps only the output and a
log-sum-exp where the call allows one, so the simulation calls the fused op (``FusedAttention``)
where the target backend says its torch would (Backend.runs_fused_attention: CPU's kernel cannot
take attention dropout, CUDA's fused kernels can; CUDA's fp32 kernel cannot share grouped
key/value heads, CPU's can).
Hooks on the units mark where the engine gathers a unit (before its forward, with `prefetch`
units ahead; again before its backward), reshards it after forward, and after its backward
releases it, reduces and keeps a gradient shard; the full-size gradients autograd made are
dropped there as the engine drops them. The engine's buffers themselves are added by the replay
(replay.py), so one recording serves every strategy, world size and offload. Activation
checkpointing wraps each unit as ``shardkit.wrap.checkpoint_layers`` does, so its recomputation
is simulated, not assumed.

On CPU the simulated high-water mark equals what torch's allocator reports for the same unsharded
step (tests/test_planner_activations.py); for the sharded step it is checked against a measured
2-rank run.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import sys
import weakref
from unittest import mock
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from typing_extensions import override

from ..capabilities import AttentionCall, fused_attention_on_cpu
from ..errors import ShardkitError
from .replay import AFTER_FORWARD, ALLOC, FREE, GATHER, KEEP, REDUCE, RELEASE, StepRecord

InputsFn = Callable[[int, int], tuple[tuple, dict]]


class LiveBytes(TorchDispatchMode):
    """Bytes of every tensor storage an op created that is still alive, and their maximum.

    With `events` given, each allocation appends ("alloc", nbytes) and each free ("free", n),
    n numbering the allocations in order (see replay.py)."""

    def __init__(self, ignore: set[int], events: list[tuple] | None = None) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.events = events
        self._ignore = ignore  # storages that exist before the step (parameters)
        self._alive: dict[int, weakref.ref] = {}
        self._allocations = 0

    def track(self, tensor: torch.Tensor) -> None:
        """Count `tensor`'s storage from now until it is freed (once, however many views share it)."""
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._alive or key in self._ignore:
            return
        nbytes = storage.nbytes()
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        number = self._allocations
        self._allocations += 1
        if self.events is not None:
            self.events.append((ALLOC, nbytes))
        # Storages keep their Python object while alive, so the weakref dies with the storage.
        self._alive[key] = weakref.ref(storage, functools.partial(self._freed, key, nbytes, number))

    def _freed(self, key: int, nbytes: int, number: int, _ref: object = None) -> None:
        if self._alive.pop(key, None) is not None:
            self.live -= nbytes
            if self.events is not None:
                self.events.append((FREE, number))

    @override
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        """Run the op and count the storages it created."""
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.track(leaf)
        return out


class FusedAttention(TorchFunctionMode):
    """Route scaled_dot_product_attention to a fused kernel's op where the target device's torch
    would take one (`runs_fused`: Backend.runs_fused_attention; default torch's CPU kernel)."""

    def __init__(self, runs_fused: Callable[[AttentionCall], bool] = fused_attention_on_cpu) -> None:
        super().__init__()
        self.runs_fused = runs_fused

    @override
    def __torch_function__(self, func, types, args=(), kwargs=None):
        """Call the fused attention op in place of the math fallback meta would take."""
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or not self.runs_fused(attention_call(args, kwargs)):
            return func(*args, **kwargs)
        return _fused_attention(*args, **kwargs)


def attention_call(args: tuple, kwargs: dict) -> AttentionCall:
    """What a device's kernel choice depends on, read off scaled_dot_product_attention's arguments."""
    query, key = args[0], args[1]
    mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
    dropout = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
    grouped = bool(kwargs.get("enable_gqa", False)) or key.shape[-3] != query.shape[-3]
    return AttentionCall(dtype=query.dtype, dropout=dropout > 0, masked=mask is not None,
                         mask_needs_grad=bool(getattr(mask, "requires_grad", False)),
                         grouped_query=grouped, head_dim=query.shape[-1])


def _fused_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                     is_causal: bool = False, scale: float | None = None,
                     enable_gqa: bool = False) -> torch.Tensor:
    # The fused kernel shares key/value heads among query heads itself (grouped-query
    # attention), as it does off meta: no repeated copies.
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


def _with_fused_attention(forward: Callable, runs_fused: Callable[[AttentionCall], bool]) -> Callable:
    @functools.wraps(forward)
    def run(*args, **kwargs):
        with FusedAttention(runs_fused):
            return forward(*args, **kwargs)
    return run


def token_inputs(model: nn.Module) -> InputsFn:
    """Inputs for a language model as a training step calls it: input_ids, labels where the
    forward takes them (HF), decoder_input_ids for an encoder-decoder, and use_cache=False (the
    key/value cache is for generation: kept, it holds every layer's keys and values to the end
    of the step, which defeats activation checkpointing; HF's Trainer turns it off too)."""
    accepted = inspect.signature(model.forward).parameters

    def make(batch: int, seq: int) -> tuple[tuple, dict]:
        ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
        if "input_ids" not in accepted:
            return (ids,), {}
        kwargs: dict[str, Any] = {"input_ids": ids}
        if "decoder_input_ids" in accepted:
            kwargs["decoder_input_ids"] = ids
        if "use_cache" in accepted:
            kwargs["use_cache"] = False
        if "labels" in accepted:
            kwargs["labels"] = ids
        return (), kwargs
    return make


@contextlib.contextmanager
def unpacked_sequences() -> Iterator[None]:
    """Tell transformers' masks the batch holds no packed sequences without reading positions.

    Without a cache, HF decoders look for several sequences packed into one row by reading the
    position ids (`.all()` on a tensor), which meta cannot answer; the simulated ids are one
    sequence per row, so the answer is known: none are packed."""
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None or not hasattr(masking, "find_packed_sequence_indices"):
        yield
        return
    with mock.patch.object(masking, "find_packed_sequence_indices", lambda *args, **kwargs: None):
        yield


def _loss(output: Any) -> torch.Tensor:
    """The loss a user would take: HF's own, else cross-entropy over the last dim in fp32."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    logits = output[0] if isinstance(output, (tuple, list)) else getattr(output, "logits", output)
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise ShardkitError("plan(batch=...) could not find a loss or logits in the model's output "
                            f"({type(output).__name__}); HINT: pass example_inputs= and a model "
                            "whose forward returns a tensor or an object with .loss")
    flat = logits.reshape(-1, logits.shape[-1]).float()
    return F.cross_entropy(flat, torch.zeros(flat.shape[0], dtype=torch.long, device="meta"))


class _Recorder:
    """Marks the engine's moments among the step's events, and drops gradients where it does."""

    def __init__(self, modules: list[nn.Module], events: list[tuple], direct_numel: int | None) -> None:
        self.modules, self.events = modules, events  # units in the engine's order, root last
        self.direct_numel = direct_numel  # Capabilities.direct_collective_numel
        self.in_flight: list[torch.Tensor] = []  # direct gradients of the last reduced unit
        self.pending: dict[int, int] = {}  # unit -> its trainable parameters
        self.ready: dict[int, list[nn.Parameter]] = {}  # unit -> those with a gradient so far
        self.handles: list[Any] = []

    def install(self) -> None:
        """Hook every unit's module; `remove` takes the hooks off again."""
        root = len(self.modules) - 1
        for i, module in enumerate(self.modules):
            # Gather order: this unit, then (with prefetch) the next ones in forward, the
            # previous ones in backward; the root stays gathered and is never prefetched.
            ahead = (i,) if i == root else tuple(range(i, root))
            behind = tuple(range(i, -1, -1))
            self.handles += [
                module.register_forward_pre_hook(lambda *_, o=ahead: self.events.append((GATHER, o))),
                module.register_forward_hook(lambda *_, i=i: self.events.append((AFTER_FORWARD, i))),
            ]
            if i != root:  # the root stays gathered (and its output may be no tensor)
                self.handles.append(module.register_full_backward_pre_hook(
                    lambda *_, o=behind: self.events.append((GATHER, o))))
            trainable = [p for p in _own_params(module, self.modules) if p.requires_grad]
            self.pending[i] = len(trainable)
            for p in trainable:
                self.handles.append(p.register_post_accumulate_grad_hook(
                    lambda p, i=i: self._grad_ready(i, p)))

    def _grad_ready(self, i: int, param: nn.Parameter) -> None:
        self.ready.setdefault(i, []).append(param)
        if len(self.ready[i]) < self.pending[i]:
            return
        # The engine's post-backward, in its order: free the gathered parameters, finish the
        # previous unit's reduction (its input dies), pack this unit's gradients into a reduce
        # input (large parameters reduce straight out of their gradient instead), which lives
        # until the next unit's post-backward; only the reduced shard stays.
        self.events.append((RELEASE, i))
        self.in_flight = []
        self.events.append((REDUCE, i))
        direct = []
        for p in self.ready.pop(i):
            if self.direct_numel is not None and p.numel() >= self.direct_numel:
                direct.append(p.grad)
            p.grad = None
        self.events.append((KEEP, i))
        self.in_flight = direct  # type: ignore[assignment]

    def remove(self) -> None:
        """Take every hook off."""
        for handle in self.handles:
            handle.remove()


def _own_params(module: nn.Module, modules: list[nn.Module]) -> list[nn.Parameter]:
    """The parameters of `module` that no nested unit claims (each distinct parameter once)."""
    inside = {id(m) for m in module.modules()}
    nested = {id(p) for m in modules if m is not module and id(m) in inside for p in m.parameters()}
    return [p for p in module.parameters() if id(p) not in nested]


def record_step(model: nn.Module, units: list[nn.Module], batch: int, seq: int,
                inputs: InputsFn | None, compute_dtype: torch.dtype | None,
                checkpoint_classes: tuple[type, ...], direct_numel: int | None = None,
                runs_fused: Callable[[AttentionCall], bool] = fused_attention_on_cpu) -> StepRecord:
    """Run one forward + backward of `model` on meta at (batch, seq) and record its events.

    `units` are the engine's unit modules of `model` in its order, root last. Gradients are
    dropped as the engine drops them; its own buffers are left to the replay (replay.py)."""
    from ..sharding.surface.recipes import checkpoint_layers

    with torch.device("meta"):
        twin = copy.deepcopy(model).to("meta")  # hooks, casts and checkpointing stay off `model`
    if compute_dtype is not None:
        for p in twin.parameters():
            if p.is_floating_point():
                p.data = p.data.to(compute_dtype)
    index = {id(m): i for i, m in enumerate(model.modules())}
    twin_modules = list(twin.modules())
    twin_units = [twin_modules[index[id(m)]] for m in units]
    if checkpoint_classes:
        # Recomputation runs on autograd's thread, where the mode entered below is not active.
        for layer in twin.modules():
            if isinstance(layer, checkpoint_classes):
                layer.forward = _with_fused_attention(layer.forward, runs_fused)
        checkpoint_layers(twin, checkpoint_classes)
    args, kwargs = (inputs or token_inputs(twin))(batch, seq)
    events: list[tuple] = []
    tracker = LiveBytes({p.untyped_storage()._cdata for p in twin.parameters()}, events)
    recorder = _Recorder(twin_units, events, direct_numel)
    recorder.install()
    try:
        with tracker, FusedAttention(runs_fused), unpacked_sequences():
            _loss(twin(*args, **kwargs)).backward()
    except ShardkitError:
        raise
    except Exception as exc:
        raise ShardkitError(
            f"simulating a training step of {type(model).__name__} on the meta device failed "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). A forward that "
            "reads tensor values (data-dependent control flow) cannot run there. HINT: plan without "
            "batch= (the peak then leaves activations out), or pass example_inputs=fn(batch, seq) "
            "returning (args, kwargs) that the forward accepts") from exc
    finally:
        recorder.remove()
    return StepRecord(batch, tuple(events))
