"""Training code's view of a sharded parameter: its global shape, its full tensor, its rows.

After shard() a parameter is a DTensor of the whole parameter (sharding/step/whole_view.py), whose own
shape and full_tensor() already answer for the whole; where no DeviceMesh exists (XLA's device
threads) it is this rank's rows (same dimensions, fewer rows). These functions answer the same
on both routes, so code that needs the whole tensor (an optimizer that orthogonalises whole
matrices, a fan-in computed from the global shape) runs on every backend. Every function also
takes a plain parameter and then answers for it unchanged, so the same optimizer or script runs
sharded and unsharded.

The engine's parameter objects are looked up by identity in a registry of weak references:
nothing is attached to the nn.Parameter itself, so pickling or copying one never drags engine
state along, and a dropped model frees its entries.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from ...errors import ShardkitError
from ..step.whole_view import full_of, is_dtensor

if TYPE_CHECKING:
    from ..step.param import ShardedParam
    from ..step.state import ShardState

_REGISTRY: dict[int, tuple[weakref.ref, weakref.ref, weakref.ref]] = {}


def forget_params() -> None:
    """Forget every sharded parameter (process_state.reset)."""
    _REGISTRY.clear()


def remember_params(state: "ShardState") -> None:
    """Make every sharded parameter of `state` answerable by full_shape/full_tensor/local_shard."""
    for key in [k for k, (param, _, _) in _REGISTRY.items() if param() is None]:
        del _REGISTRY[key]
    for sp in state.iter_params():
        _REGISTRY[id(sp.sharded)] = (weakref.ref(sp.sharded), weakref.ref(sp), weakref.ref(state))


def _lookup(param: torch.Tensor) -> tuple["ShardedParam", "ShardState"] | None:
    entry = _REGISTRY.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    sp, state = entry[1](), entry[2]()
    return None if sp is None or state is None else (sp, state)


def grad_owners() -> dict[int, tuple["ShardState", "ShardedParam"]]:
    """id(.grad) -> (engine state, ShardedParam), for every live shard that has a gradient now."""
    owners: dict[int, tuple["ShardState", "ShardedParam"]] = {}
    for param_ref, sp_ref, state_ref in list(_REGISTRY.values()):
        param, sp, state = param_ref(), sp_ref(), state_ref()
        if param is not None and sp is not None and state is not None and param.grad is not None:
            owners[id(param.grad)] = (state, sp)
    return owners


def is_sharded_param(param: torch.Tensor) -> bool:
    """True for a parameter object that shard() made (a live model's shard)."""
    return _lookup(param) is not None


def full_shape(param: torch.Tensor) -> torch.Size:
    """The parameter's shape before shard() (its own shape if it is not sharded); no communication."""
    found = _lookup(param)
    return param.shape if found is None else found[0].whole_shape


def held_numel(param: torch.Tensor) -> int:
    """Elements this rank keeps for a parameter: its padded shard's for a sharded one (a DTensor
    counts only the real rows it views), its own numel() otherwise."""
    found = _lookup(param)
    return param.numel() if found is None else found[0].shard_numel


def full_tensor(param: torch.Tensor, local: torch.Tensor | None = None) -> torch.Tensor:
    """Collective over the parameter's shard group: the full tensor of `local` (default: the
    parameter's values), a tensor laid out like this rank's shard such as `param.grad` or an
    optimizer's momentum; every rank of the group must call it for the same parameter.

    Returns a new tensor of full_shape(param) in `local`'s dtype on its device; for a parameter
    that is not sharded, `local` itself.
    """
    local = param.detach() if local is None else local.detach()
    found = _lookup(param)
    if found is None:
        return local
    sp, state = found
    if is_dtensor(local):
        if local.shape != sp.whole_shape:
            raise ShardkitError(f"full_tensor({sp.fqn!r}): the DTensor given has shape "
                                f"{tuple(local.shape)}, the parameter {tuple(sp.whole_shape)}")
        return full_of(local)
    if sp.tp_spec is not None:
        raise ShardkitError(
            f"full_tensor({sp.fqn!r}): a plain tensor of a tensor-parallel parameter's rows says "
            "nothing of its other dimension. HINT: pass the DTensor (p.grad, or state made by "
            "torch.zeros_like(p)), or call .full_tensor() on it")
    if local.shape != sp.shard_shape:
        raise ShardkitError(f"full_tensor({sp.fqn!r}): the tensor given has shape "
                            f"{tuple(local.shape)}, this rank's shard has {tuple(sp.shard_shape)}. "
                            "HINT: pass a tensor laid out like the sharded parameter (its .grad, "
                            "or optimizer state created with torch.zeros_like(param))")
    inp = local.reshape(-1).to(state.device).contiguous()
    out = torch.empty(sp.padded_numel, dtype=inp.dtype, device=state.device)
    state.stats.all_gather(inp.numel() * inp.element_size(), state.shard_group.size,
                           state.stats.crosses_node(state.shard_group))
    state.backend.collectives.all_gather_into_tensor(out, inp, state.shard_group, async_op=False).wait()
    return out[:sp.numel].view(sp.full_shape).to(local.device)


def local_shard(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's rows of `full` (a tensor of full_shape(param)), laid out like the sharded
    parameter with zero padding rows; `full` itself for a parameter that is not sharded. No
    communication: every rank computes the same full tensor and keeps its own rows."""
    found = _lookup(param)
    if found is None:
        return full
    sp = found[0]
    if sp.tp_spec is not None:
        raise ShardkitError(
            f"local_shard({sp.fqn!r}) does not handle tensor-parallel parameters yet. HINT: "
            "torch.distributed.tensor.distribute_tensor(full, p.device_mesh, p.placements, "
            "src_data_rank=None) makes the DTensor laid out like p")
    if full.shape != sp.full_shape:
        raise ShardkitError(f"local_shard({sp.fqn!r}): the tensor given has shape "
                            f"{tuple(full.shape)}, the parameter's full shape is "
                            f"{tuple(sp.full_shape)}. HINT: pass a tensor of full_shape(param)")
    return sp.as_user(sp.rows_of(full, sp.local.device))
