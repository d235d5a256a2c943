"""The optimizer steps DTensor parameters through the plain tensors they hold: the same numbers at
plain-tensor speed (issue 53).

A sharded parameter is a DTensor (sharding/step/whole_view.py), so torch's optimizers step it
through DTensor's dispatch: every op of the update unwraps, checks shardings and wraps again,
about 0.09 ms per parameter tensor per step with foreach Adam on a 2-core host (4 ms -> 14 ms for
104 tensors; FSDP2's parameters pay the same). For an *elementwise* optimizer (each element's new
value reads only that element of the parameter, its gradient and its state, plus scalars) that
dispatch adds nothing: sharded by rows or replicated, the update of the local tensor is the
update. So for such an optimizer `optimizer.step()` hands the step the local tensors (parameter,
gradient, each state tensor shaped like the parameter) and puts the DTensors back before it
returns: what the user's code, torch's `state_dict()`, DCP and LR schedulers see is unchanged;
only the numbers moved, and they are the numbers the dispatch computes (the same kernels). A step
traced by torch.compile is left as the user wrote it (through the DTensors).

Which optimizers: torch's elementwise ones by exact class (`ELEMENTWISE`), and any class the user
declares with `shardkit.elementwise_optimizer` (a Lion, a user's SGD variant). A subclass or an
optimizer from elsewhere is stepped through the dispatch unless declared, because a step that
reads `p.norm()` (LAMB's trust ratio), a factored second moment (Adafactor) or a whole matrix
(Muon) would, handed a shard, silently compute something else.

How it is reached: the global step pre-hook (sharding/setup/stale_optimizer.py) sees each
optimizer at its first step and `adopt`s an elementwise one that holds DTensor parameters: an
instance-level `step` in front of the class's. That first step runs through the dispatch as
before, so the state is created exactly as torch creates it (DTensors for tensors shaped like the
parameter, plain 0-d `step` counters). Each later step checks, per parameter, that the local path
computes the dispatch's result (the gradient and every state tensor laid out like the parameter,
none `Partial`; no state still to be created; no per-optimizer step hooks, which would see the
local tensors; not `differentiable`), swaps, steps, and restores in a `finally`, so an exception
(an OOM the caller catches) leaves the optimizer as it was. A closure is called first, outside
the swap, as torch's optimizers call it before their update.

`SHARDKIT_LOCAL_STEP=0` turns it off (every step through the dispatch).
"""

from __future__ import annotations

import types
import weakref
from collections import defaultdict
from itertools import chain, repeat
from operator import attrgetter, is_, is_not
from typing import Any, Callable

import torch

from ...env_flags import LOCAL_STEP, env_flag
from ..step.whole_view import whole, whole_spec
from .param_access import is_sharded_param

from torch.distributed.tensor import DTensor

# torch's optimizers whose update is elementwise (by exact class: a subclass may override step).
ELEMENTWISE: frozenset[type] = frozenset(
    getattr(torch.optim, name) for name in (
        "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "RMSprop", "Adadelta",
        "ASGD", "Rprop") if hasattr(torch.optim, name))

_declared: "weakref.WeakSet[type]" = weakref.WeakSet()  # user-declared elementwise classes
# optimizer -> its exchange (which holds no reference to the optimizer)
_adopted: "weakref.WeakKeyDictionary[torch.optim.Optimizer, _LocalSteps]" = weakref.WeakKeyDictionary()
_enabled = False  # set by adopt(); shutdown() clears it, so a stale instance step passes through


def elementwise_optimizer(cls: type) -> type:
    """Declare that `cls.step` updates each element from that element alone (usable as a decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        from ...errors import ShardkitError

        raise ShardkitError(
            f"shardkit.elementwise_optimizer takes a torch.optim.Optimizer subclass, got {cls!r}. "
            "HINT: declare the class (shardkit.elementwise_optimizer(Lion)), not an instance")
    _declared.add(cls)
    return cls


def forget_declared() -> None:
    """Forget every class shardkit.elementwise_optimizer declared (process_state.reset)."""
    _declared.clear()


def is_elementwise(optimizer: torch.optim.Optimizer) -> bool:
    """True when `optimizer`'s class is one whose step may run on local tensors."""
    cls = type(optimizer)
    return cls in ELEMENTWISE or cls in _declared


def adopt(optimizer: torch.optim.Optimizer) -> None:
    """Put the local-tensor step in front of `optimizer.step` (its first step; idempotent)."""
    global _enabled
    if optimizer in _adopted or not is_elementwise(optimizer) or not env_flag(LOCAL_STEP, True):
        return
    if not any(_is_dtensor(p) and is_sharded_param(p)
               for group in optimizer.param_groups for p in group["params"]):
        return  # not a shardkit model's optimizer (a plain model's, FSDP2's): left as it is
    # An instance-level wrapper already there (an LR scheduler's step counter) stays in the chain.
    steps = _LocalSteps(optimizer.__dict__.get("step"))

    def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        return steps.step(self, args, kwargs)

    step._shardkit_local_step = True  # type: ignore[attr-defined]
    inner = steps.inner
    if getattr(inner, "_wrapped_by_lr_sched", False):
        # The scheduler's step counter is still called (it is `inner`); its marker says so to
        # the scheduler, which otherwise warns that the step was overridden after it.
        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    # A bound method, as torch's LR schedulers expect of `optimizer.step` (they wrap its __func__).
    optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]
    _adopted[optimizer] = steps
    _enabled = True


def last_step_was_local(optimizer: torch.optim.Optimizer) -> bool:
    """True when `optimizer`'s last step ran on the local tensors (tests and benchmarks ask)."""
    steps = _adopted.get(optimizer)
    return steps is not None and steps.last_local


def uninstall() -> None:
    """Step every optimizer through the dispatch again (shutdown(), process_state.reset)."""
    global _enabled
    _enabled = False
    for optimizer, steps in list(_adopted.items()):
        method = optimizer.__dict__.get("step")
        if getattr(method, "_shardkit_local_step", False):  # ours is outermost: unwrap it
            if steps.inner is None:
                del optimizer.__dict__["step"]
            else:
                optimizer.__dict__["step"] = steps.inner
        # (wrapped since by someone else: ours stays in their chain and passes every step through)
    _adopted.clear()


def _is_dtensor(tensor: object) -> bool:
    return type(tensor) is DTensor


def _call(optimizer: torch.optim.Optimizer, inner: Callable[..., Any] | None, args: tuple,
          kwargs: dict) -> Any:
    if inner is not None:
        return inner(*args, **kwargs)
    return type(optimizer).step(optimizer, *args, **kwargs)


_GRAD = attrgetter("grad")
_SPEC = attrgetter("_spec")
_LOCAL = attrgetter("_local_tensor")


class _LocalSteps:
    """One optimizer's exchange of DTensors for their local tensors: checked, made, undone.

    Building the exchange reads every parameter, gradient and state entry (microseconds per
    parameter, as much as the step of a small model); it is kept between steps and checked
    against what may have changed since with identity comparisons run by C loops (`map`): the
    param lists, which parameters have gradients and their specs, the state dicts and their
    values. Anything else rebuilds it.
    """

    def __init__(self, inner: Callable[..., Any] | None) -> None:
        self.inner = inner  # the instance-level step ours stands in front of, if any
        self.built = False
        self.last_local = False

    # ---- the step ------------------------------------------------------------------------------
    def step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Any:
        """`optimizer.step(*args, **kwargs)`, on local tensors where that is the dispatch's result."""
        inner = self.inner
        self.last_local = False
        if (not _enabled or optimizer._optimizer_step_pre_hooks
                or optimizer._optimizer_step_post_hooks or torch.compiler.is_compiling()):
            # (Inside torch.compile the step is traced as the user wrote it: through the DTensors.)
            return _call(optimizer, inner, args, kwargs)
        closure = kwargs.pop("closure", None) if "closure" in kwargs else (
            args[0] if args else None)
        args = args[1:] if args else args
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = self._current(optimizer) if self.built else None
        if grads is None:
            grads = self._build(optimizer)
            if grads is None:
                _call(optimizer, inner, args, kwargs)
                return loss
        self._enter(optimizer, grads)
        try:
            _call(optimizer, inner, args, kwargs)
        finally:
            self._leave(optimizer)
        self.last_local = True
        return loss

    # ---- building and checking the exchange ----------------------------------------------------
    def _build(self, optimizer: torch.optim.Optimizer) -> list | None:
        """Check every parameter and make the exchange; the gradients' local tensors, or None
        where the local step would not compute the dispatch's result."""
        self.built = False
        state = optimizer.state
        groups, stepped_lists = [], []
        dparams, dlocals, has_grad = [], [], []
        params_g, locals_g, specs_g, helds_g, mines_g, local_grads = [], [], [], [], [], []
        local_state: defaultdict = defaultdict(dict)
        plain_new = []
        for group in optimizer.param_groups:
            if group.get("differentiable"):
                return None  # autograd through the step: the DTensors' graph, not the locals'
            params = group["params"]
            stepped = []
            for p in params:
                if not _is_dtensor(p):
                    stepped.append(p)
                    if p in state:
                        local_state[p] = state[p]  # the same dict: updates land in place
                    else:
                        plain_new.append(p)
                    continue
                local = p._local_tensor
                stepped.append(local)
                grad = p.grad
                dparams.append(p)
                dlocals.append(local)
                has_grad.append(grad is not None)
                if grad is None:
                    continue  # the step skips it
                spec = p._spec
                if (not _is_dtensor(grad) or not _same_layout(grad._spec, spec)
                        or grad._local_tensor.shape != local.shape):
                    return None  # a Partial or otherwise laid out gradient
                held = state.get(p)
                if held is None:
                    if p.dim() == 0:
                        return None  # a 0-d state tensor: DTensor or scalar? as torch makes it
                    held = state[p]
                mine = {}
                for key, value in held.items():
                    if _is_dtensor(value):
                        if (not _same_layout(value._spec, spec)
                                or value._local_tensor.shape != local.shape):
                            return None
                        mine[key] = value._local_tensor
                    elif isinstance(value, torch.Tensor) and value.dim() != 0:
                        return None  # a plain tensor beside a DTensor parameter
                    else:
                        mine[key] = value
                local_state[local] = mine
                params_g.append(p)
                locals_g.append(local)
                specs_g.append(grad._spec)
                helds_g.append(held)
                mines_g.append(mine)
                local_grads.append(grad._local_tensor)
            groups.append((group, params, len(params)))
            stepped_lists.append(stepped)
        if not params_g:
            return None
        self.state, self.groups, self.stepped = state, groups, stepped_lists
        self.ngroups = len(optimizer.param_groups)
        self.dparams, self.dlocals, self.has_grad = dparams, dlocals, has_grad
        self.params_g, self.locals_g, self.specs_g = params_g, locals_g, specs_g
        self.helds_g, self.mines_g = helds_g, mines_g
        self.local_state, self.plain_new = local_state, plain_new
        # torch's own optimizers update existing state in place (their update functions take
        # lists of the state tensors); only a new entry needs wrapping after their step.
        self.in_place = type(optimizer) in ELEMENTWISE
        self._snapshot()
        self.built = True
        return local_grads

    def _snapshot(self) -> None:
        # Every parameter's state dict, in the state's order: read without hashing a tensor
        # (a DTensor's __hash__ is Python code), it shows a dict replaced, added or removed.
        self.state_dicts = list(self.state.values())
        self.values = list(chain.from_iterable(map(dict.values, self.helds_g)))
        self.local_values = list(chain.from_iterable(map(dict.values, self.mines_g)))
        self.local_len = len(self.local_state)

    def _current(self, optimizer: torch.optim.Optimizer) -> list | None:
        """The gradients' local tensors when nothing the exchange rests on changed; else None."""
        if optimizer.state is not self.state or len(optimizer.param_groups) != self.ngroups:
            return None
        for group, params, count in self.groups:
            if group["params"] is not params or len(params) != count:
                return None
        if not all(map(is_, map(_LOCAL, self.dparams), self.dlocals)):
            return None  # a parameter's data replaced (`p.data = ...`, an EMA swap)
        grads = list(map(_GRAD, self.dparams))
        if list(map(is_not, grads, repeat(None))) != self.has_grad:
            return None
        grads = [g for g in grads if g is not None]
        if not all(map(is_, map(_SPEC, grads), self.specs_g)):
            return None
        state = self.state
        if len(state) != len(self.state_dicts) or not all(
                map(is_, state.values(), self.state_dicts)):
            return None
        if sum(map(len, self.helds_g)) != len(self.values) or not all(
                map(is_, chain.from_iterable(map(dict.values, self.helds_g)), self.values)):
            return None  # state replaced between steps (a reset, a load)
        return list(map(_LOCAL, grads))

    # ---- the exchange --------------------------------------------------------------------------
    def _enter(self, optimizer: torch.optim.Optimizer, local_grads: list) -> None:
        for (group, _, _), stepped in zip(self.groups, self.stepped):
            group["params"] = stepped
        for _ in map(setattr, self.locals_g, repeat("grad"), local_grads):
            pass
        optimizer.state = self.local_state

    def _leave(self, optimizer: torch.optim.Optimizer) -> None:
        """Put the DTensors back; state the step made or replaced is wrapped like the parameter."""
        optimizer.state = self.state
        for group, params, _ in self.groups:
            group["params"] = params
        for _ in map(setattr, self.locals_g, repeat("grad"), repeat(None)):
            pass
        if (len(self.local_state) == self.local_len
                and sum(map(len, self.mines_g)) == len(self.local_values)
                and (self.in_place or all(map(is_, chain.from_iterable(
                    map(dict.values, self.mines_g)), self.local_values)))):
            return  # updated in place, as torch's optimizers do after the state's first step
        for p, local, held, mine in zip(self.params_g, self.locals_g, self.helds_g, self.mines_g):
            for key, value in mine.items():
                old = held.get(key)
                if old is value or (_is_dtensor(old) and old._local_tensor is value):
                    continue
                held[key] = _like_param(p, local, old, value)
            if len(held) != len(mine):
                for key in [k for k in held if k not in mine]:
                    del held[key]
        for p in self.plain_new:
            if p in self.local_state:
                self.state[p] = self.local_state[p]  # a plain parameter's first state
        self.built = False  # rebuilt from the state as it now is


def _same_layout(spec: Any, other: Any) -> bool:
    # Meshes compare by value: torch's sharding propagation may hand back a spec it cached for
    # an equal mesh of another model.
    return (spec.mesh is other.mesh or spec.mesh == other.mesh) \
        and spec.placements == other.placements \
        and not any(p.is_partial() for p in spec.placements)


def _like_param(p: Any, local: torch.Tensor, old: Any, value: Any) -> Any:
    """State the step made or replaced, laid out as torch's dispatch would have made it."""
    if not isinstance(value, torch.Tensor):
        return value
    if _is_dtensor(old) and value.shape == old._local_tensor.shape:
        spec = old._spec  # a DTensor replaced by a new tensor: the same layout
    elif value.dim() == 0 or value.shape != local.shape:
        return value  # a scalar (a step count), as torch keeps it
    else:
        spec = p._spec
    if value.dtype != spec.tensor_meta.dtype:
        spec = whole_spec(spec.mesh, spec.placements, p.shape, value.dtype)
    return whole(value, spec)
