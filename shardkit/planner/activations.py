"""Tracking a step's memory on the meta device: the tracker, attention as the device runs it.

Activations are the largest term of a transformer's peak and depend on everything the step does
(attention layout, the loss, which ops save what), so they are not estimated from a formula: the
step runs on the meta device (planner/rehearsal.py: the real engine and optimizer), where ops
compute shapes and nothing is allocated, and every tensor an op creates is tracked until its
storage dies (``LiveBytes``). On meta, `scaled_dot_product_attention` would fall back to its
math path and keep the (seq x seq) scores; on CPU and GPU torch runs a fused kernel that keeps
only the output and a log-sum-exp where the call allows one, so the rehearsal calls the fused
op (``FusedAttention``) where the target backend says its torch would
(Capabilities.fused_attention: CPU's kernel cannot take attention dropout, CUDA's fused kernels
can; CUDA's fp32 kernel cannot share grouped key/value heads, CPU's can).

On CPU the tracked high-water mark equals what torch's allocator reports for the same unsharded
step (tests/test_planner_activations.py); sharded steps are checked against measured runs.
"""

from __future__ import annotations

import contextlib
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
from ..kernel_workspace import KernelCall
from ..errors import ShardkitError
from .replay import ALLOC, FREE

InputsFn = Callable[[int, int], tuple[tuple, dict]]


class LiveBytes(TorchDispatchMode):
    """Bytes of every tensor storage an op created that is still alive, and their maximum.

    Storages the engine frees and gives back in place (Backend.free_storage / alloc_storage: a
    resize is no op this mode sees) are reported through `resized`. From `begin_window()` on,
    each allocation appends ("alloc", nbytes) to the window's events and each free ("free", n),
    n numbering the window's allocations in order (see replay.py); the storages alive when the
    window begins open it as allocations of their own."""

    def __init__(self, ignore: set[int] | frozenset[int] = frozenset(),
                 workspace: Callable[[KernelCall], int] | None = None, threads: int = 1) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.workspace, self.threads = workspace, threads  # Capabilities.kernel_workspace
        self._ignore = ignore  # storages that exist before the step (parameters)
        self._alive: dict[int, tuple[int, int]] = {}  # storage -> (nbytes, allocation number)
        self._refs: dict[int, weakref.ref] = {}
        self._allocations = 0
        self._window: dict[int, int] | None = None  # allocation number -> its number in the window
        self._events: list[tuple] = []
        self._scratch = 0

    def track(self, tensor: torch.Tensor) -> None:
        """Count `tensor`'s storage from now until it is freed (once, however many views share it)."""
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._alive or key in self._ignore:
            return
        if key not in self._refs:
            # Storages keep their Python object while alive, so the weakref dies with the storage.
            self._refs[key] = weakref.ref(storage, functools.partial(self._died, key))
        self._allocate(key, storage.nbytes())

    def resized(self, storage: torch.UntypedStorage) -> None:
        """The engine resized `storage` in place: to 0 frees it, to its bytes allocates it anew."""
        key = storage._cdata
        self._free(key)
        if storage.nbytes():
            if key not in self._refs:
                self._refs[key] = weakref.ref(storage, functools.partial(self._died, key))
            self._allocate(key, storage.nbytes())

    def allocation_of(self, key: int) -> int | None:
        """The number of the allocation the storage `key` holds now, None when it holds none."""
        entry = self._alive.get(key)
        return None if entry is None else entry[1]

    def begin_window(self) -> None:
        """Start recording events; what is alive now opens the window as its first allocations."""
        self._window, self._events = {}, []
        for key, (nbytes, number) in sorted(self._alive.items(), key=lambda kv: kv[1][1]):
            self._open(key, nbytes, number)
        self.peak = self.live

    def window_events(self, leave_out: set[int] | frozenset[int] = frozenset()) -> tuple[tuple, ...]:
        """The window's events, without the allocations of storages in `leave_out` that are
        still alive (the host's, under cpu_offload)."""
        assert self._window is not None
        # The allocation each storage holds now (an address is reused once a storage dies).
        dropped = {self._window[self._alive[key][1]] for key in leave_out
                   if key in self._alive and self._alive[key][1] in self._window}
        renumber: dict[int, int] = {}
        out: list[tuple] = []
        allocation = 0
        for event in self._events:
            if event[0] == ALLOC:
                if allocation not in dropped:
                    renumber[allocation] = len(renumber)
                    out.append(event)
                allocation += 1
            elif event[1] in renumber:
                out.append((FREE, renumber[event[1]]))
        return tuple(out)

    def _allocate(self, key: int, nbytes: int) -> None:
        number = self._allocations
        self._allocations += 1
        self._alive[key] = (nbytes, number)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        if self._window is not None:
            self._open(key, nbytes, number)

    def _open(self, key: int, nbytes: int, number: int) -> None:
        assert self._window is not None
        self._window[number] = len(self._window)
        self._events.append((ALLOC, nbytes))

    def _free(self, key: int) -> None:
        entry = self._alive.pop(key, None)
        if entry is None:
            return
        nbytes, number = entry
        self.live -= nbytes
        if self._window is not None and number in self._window:
            self._events.append((FREE, self._window[number]))

    def _died(self, key: int, _ref: object = None) -> None:
        self._refs.pop(key, None)
        self._free(key)

    @override
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        """Run the op and count the storages it created."""
        if on_dtensors(types):
            # DTensor then runs it as its local ops and collectives, each seen here: a DTensor
            # op's temporaries (a redistributed input) are allocations too.
            return NotImplemented
        out = _meta_kernel_gap(func, args, kwargs or {})
        if out is None:
            out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.track(leaf)
        if self.workspace is not None:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            scratch = self.workspace(KernelCall(str(func), tuple(tuple(t.shape) for t in tensors),
                                                tuple(t.dtype for t in tensors), self.threads))
            if scratch:
                # The kernel's scratch lives while it runs, beside its inputs and outputs.
                self._scratch -= 1
                self._allocate(self._scratch, scratch)
                self._free(self._scratch)
        return out


def on_dtensors(types: Any) -> bool:
    """Whether an op's tensor types include torch's DTensor (tensor parallelism's parameters).

    A dispatch mode sees a DTensor op before DTensor does, with DTensors for arguments: their
    storage a stand-in of the global size, and the op's own work (local ops, the collectives
    of a redistributed input) run unseen inside. Returning NotImplemented hands it to DTensor,
    whose local ops and collectives then come to the mode one by one."""
    return any(t.__name__ == "DTensor" and t.__module__.startswith("torch.distributed")
               for t in types)


# torch's grouped matrix multiply, where this torch has one.
_GROUPED_MM = getattr(getattr(torch.ops.aten, "_grouped_mm", None), "default", None)


def _meta_kernel_gap(func, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """An op's result where torch's meta kernel is stricter than the device's own, else None.

    The meta kernel of `_grouped_mm` (mixture-of-experts layers) accepts only bfloat16, as the
    CUDA kernel does; the CPU kernel takes float32 too. The output's shape does not depend on
    the dtype: ask the meta kernel with bfloat16 stand-ins, answer in the inputs' dtype."""
    if func is not _GROUPED_MM or func is None:
        return None
    first, second = args[0], args[1]
    if first.device.type != "meta" or first.dtype == torch.bfloat16:
        return None
    stand_in = func(first.to(torch.bfloat16), second.to(torch.bfloat16), *args[2:], **kwargs)
    return torch.empty(stand_in.shape, dtype=kwargs.get("out_dtype") or first.dtype,
                       device="meta")


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
        if (func is not F.scaled_dot_product_attention or args[0].dim() != 4
                or not self.runs_fused(attention_call(args, kwargs))):
            # torch's fused kernels take (batch, heads, seq, dim) only; other shapes take the
            # math path on every device.
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


def with_fused_attention(forward: Callable, runs_fused: Callable[[AttentionCall], bool]) -> Callable:
    """`forward` with scaled_dot_product_attention routed as the target device would run it."""

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
def traceable_on_meta() -> Iterator[None]:
    """Answer the two questions transformers' masks ask of token values, which meta cannot.

    Without a cache, HF decoders look for several sequences packed into one row by reading the
    position ids, and skip an explicit causal mask when the padding mask is all ones (`.sum()`
    compared with the length). The simulated batch is one unpadded sequence per row, so both
    answers are known: nothing is packed, every token is real. (A batch with padding makes HF
    build a mask tensor the plan does not hold.)"""
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None:
        yield
        return
    with contextlib.ExitStack() as patches:
        if hasattr(masking, "find_packed_sequence_indices"):
            patches.enter_context(mock.patch.object(
                masking, "find_packed_sequence_indices", lambda *args, **kwargs: None))
        if hasattr(masking, "fast_all"):
            real = masking.fast_all
            patches.enter_context(mock.patch.object(
                masking, "fast_all", lambda t: True if t.device.type == "meta" else real(t)))
        yield


def model_loss(output: Any) -> torch.Tensor:
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
    return F.cross_entropy(flat, torch.zeros(flat.shape[0], dtype=torch.long, device=flat.device))
