"""A training step's memory high-water mark, found by running the step on the meta device.

Activations are the largest term of a transformer's peak and depend on everything the step does
(attention layout, the loss, which ops save what), so they are not estimated from a formula: the
model's forward and backward run on the meta device, where ops compute shapes and nothing is
allocated, and every tensor an op creates is tracked until its storage dies (``LiveBytes``).
The engine's own buffers are stood in for by meta placeholders created and dropped where the
engine creates and frees them: a unit's gathered parameters (before its forward, with `prefetch`
units ahead; after forward kept whole, kept as a 1/k slice or dropped by
reshard_after_forward; again before its backward), the root unit gathered throughout, and after
a unit's backward the flat reduce-scatter input, while the full-size gradients autograd made are
dropped as the engine drops them. Activation checkpointing wraps each unit as
``shardkit.wrap.checkpoint_layers`` does, so its recomputation is simulated, not assumed.

On CPU the simulated high-water mark equals what torch's allocator reports for the same unsharded
step (tests/test_planner_activations.py); for the sharded step it is checked against a measured
2-rank run.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from typing_extensions import override

from ..errors import ShardkitError

InputsFn = Callable[[int, int], tuple[tuple, dict]]


class LiveBytes(TorchDispatchMode):
    """Bytes of every tensor storage an op created that is still alive, and their maximum."""

    def __init__(self, ignore: set[int]) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._ignore = ignore  # storages that exist before the step (parameters)
        self._alive: dict[int, weakref.ref] = {}

    def track(self, tensor: torch.Tensor) -> None:
        """Count `tensor`'s storage from now until it is freed (once, however many views share it)."""
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._alive or key in self._ignore:
            return
        nbytes = storage.nbytes()
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        # Storages keep their Python object while alive, so the weakref dies with the storage.
        self._alive[key] = weakref.ref(storage, functools.partial(self._freed, key, nbytes))

    def _freed(self, key: int, nbytes: int, _ref: object = None) -> None:
        if self._alive.pop(key, None) is not None:
            self.live -= nbytes

    @override
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        """Run the op and count the storages it created."""
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.track(leaf)
        return out


@dataclass
class UnitBuffers:
    """What the engine allocates for one unit: sizes in bytes and when it frees them."""

    module: nn.Module
    gathered_bytes: int  # the unit's parameters gathered, in the compute dtype
    reduce_bytes: int  # the flat reduce-scatter input of its trainable gradients
    grad_shard_bytes: int  # the reduced gradient shard it keeps (0 when offloaded to the host)
    reshard_after_forward: bool | int
    root: bool = False


def token_inputs(model: nn.Module) -> InputsFn:
    """Inputs for a language model: input_ids, and labels where the forward takes them (HF);
    an encoder-decoder also gets decoder_input_ids and use_cache=False (its decoder cache
    breaks recomputation under activation checkpointing, so training runs without it)."""
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


class _Engine:
    """Meta placeholders standing in for the engine's gathered and reduce buffers, unit by unit."""

    def __init__(self, units: list[UnitBuffers], tracker: LiveBytes, prefetch: int,
                 direct_numel: int | None) -> None:
        self.units, self.tracker, self.prefetch = units, tracker, prefetch
        self.direct_numel = direct_numel  # Capabilities.direct_collective_numel
        self.in_flight: list[torch.Tensor] = []  # the reduce input of the last reduced unit
        self.gathered: dict[int, torch.Tensor] = {}
        self.pending: dict[int, int] = {}  # unit -> its trainable parameters
        self.ready: dict[int, list[nn.Parameter]] = {}  # unit -> those with a gradient so far
        self.kept: list[torch.Tensor] = []  # gradient shards: they outlive the step
        self.handles: list[Any] = []

    def _placeholder(self, nbytes: int) -> torch.Tensor:
        t = torch.empty(nbytes, dtype=torch.uint8, device="meta")
        self.tracker.track(t)
        return t

    def _gather(self, order: list[int]) -> None:
        for i in order[:1 + self.prefetch]:
            if self.gathered.get(i) is None or self.gathered[i].numel() < self.units[i].gathered_bytes:
                self.gathered[i] = self._placeholder(self.units[i].gathered_bytes)

    def install(self) -> None:
        """Hook every unit's module; `remove` takes the hooks off again."""
        forward_order = list(range(len(self.units)))
        for i, unit in enumerate(self.units):
            later = [j for j in forward_order if j >= i and not self.units[j].root]
            earlier = [j for j in reversed(forward_order) if j <= i and not self.units[j].root]
            ahead = [i] + [j for j in later if j != i] if not unit.root else [i]
            behind = [i] + [j for j in earlier if j != i] if not unit.root else [i]
            self.handles += [
                unit.module.register_forward_pre_hook(lambda *_, o=ahead: self._gather(o)),
                unit.module.register_forward_hook(lambda *_, i=i: self._after_forward(i)),
            ]
            if not unit.root:  # the root stays gathered (and its output may be no tensor)
                self.handles.append(unit.module.register_full_backward_pre_hook(
                    lambda *_, o=behind: self._gather(o)))
            trainable = [p for p in _own_params(unit.module, self.units) if p.requires_grad]
            self.pending[i] = len(trainable)
            for p in trainable:
                self.handles.append(p.register_post_accumulate_grad_hook(
                    lambda p, i=i: self._grad_ready(i, p)))

    def _after_forward(self, i: int) -> None:
        unit = self.units[i]
        if unit.root or unit.reshard_after_forward is False:
            return
        kept = 0 if unit.reshard_after_forward is True else unit.gathered_bytes // unit.reshard_after_forward
        self.gathered[i] = self._placeholder(kept) if kept else None  # type: ignore[assignment]

    def _grad_ready(self, i: int, param: nn.Parameter) -> None:
        self.ready.setdefault(i, []).append(param)
        if len(self.ready[i]) < self.pending[i]:
            return
        # The engine's post-backward, in its order: free the gathered parameters, finish the
        # previous unit's reduction (its input dies), pack this unit's gradients into a reduce
        # input (large parameters reduce straight out of their gradient instead), which lives
        # until the next unit's post-backward; only the reduced shard stays.
        self.gathered[i] = None  # type: ignore[assignment]
        self.in_flight = []
        inputs = [self._placeholder(self.units[i].reduce_bytes)]
        for p in self.ready.pop(i):
            if self.direct_numel is not None and p.numel() >= self.direct_numel:
                inputs.append(p.grad)  # type: ignore[arg-type]
            p.grad = None
        self.kept.append(self._placeholder(self.units[i].grad_shard_bytes))
        self.in_flight = inputs

    def remove(self) -> None:
        """Take every hook off."""
        for handle in self.handles:
            handle.remove()


def _own_params(module: nn.Module, units: list[UnitBuffers]) -> list[nn.Parameter]:
    """The parameters of `module` that no nested unit claims (each distinct parameter once)."""
    nested = {id(p) for u in units if u.module is not module
              and any(u.module is m for m in module.modules())
              for p in u.module.parameters()}
    return [p for p in module.parameters() if id(p) not in nested]


def simulate_step(model: nn.Module, units: list[UnitBuffers], batch: int, seq: int,
                  inputs: InputsFn | None, compute_dtype: torch.dtype | None,
                  checkpoint_classes: tuple[type, ...], prefetch: int,
                  direct_numel: int | None = None) -> int:
    """Peak bytes one forward + backward of `model` adds to the parameter and optimizer shards.

    Gradient shards are counted here, as the step creates them (zero_grad(set_to_none=True),
    torch's default, frees them before the step)."""
    from ..wrap import checkpoint_layers

    with torch.device("meta"):
        twin = copy.deepcopy(model).to("meta")  # hooks, casts and checkpointing stay off `model`
    if compute_dtype is not None:
        for p in twin.parameters():
            if p.is_floating_point():
                p.data = p.data.to(compute_dtype)
    index = {id(m): i for i, m in enumerate(model.modules())}
    twin_modules = list(twin.modules())
    twin_units = [dataclasses.replace(u, module=twin_modules[index[id(u.module)]]) for u in units]
    if checkpoint_classes:
        checkpoint_layers(twin, checkpoint_classes)
    args, kwargs = (inputs or token_inputs(twin))(batch, seq)
    tracker = LiveBytes({p.untyped_storage()._cdata for p in twin.parameters()})
    engine = _Engine(twin_units, tracker, prefetch, direct_numel)
    engine.install()
    try:
        with tracker:
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
        engine.remove()
    return tracker.peak
