"""torch's gradient clipping sees whole parameters: clip_grad_norm_ and get_total_norm over shards.

A shard's gradient is this rank's rows (plain, or the local rows of a DTensor: sharding/
whole_view.py), so torch.nn.utils.clip_grad_norm_ (what
nanoGPT, transformers' Trainer, accelerate and Lightning call) would take each rank's own norm
and clip every rank by a different factor, with no error: the model trains differently from
the one the user wrote. torch's clip_grad_norm_ reads the module global `_get_total_norm` at
call time, so replacing that one name (and the public alias torch.nn.utils.get_total_norm) fixes
every caller, including scripts that imported clip_grad_norm_ before shardkit.

The replacement recognises a sharded gradient by identity (the .grad of a live shard), takes
per-tensor norms of this rank's rows as torch does, turns them into the whole parameters'
norms over the shard group (one collective per group and call, where DTensor's own norms
would run one per tensor, and refuse an inf norm over a rank with no rows), then combines every
tensor's norm exactly as torch does; gradients that are not shards pass through unchanged, and a
call that has none is torch's own. Padding rows are zero, so they add nothing to any norm of
positive order; a negative order (a minimum, which padding would make zero) is refused.
Replicas (HYBRID_SHARD) hold identical shards, so only the shard group is reduced.

A vendor library that replaced torch.nn.utils.clip_grad_norm_ itself (one that never calls
_get_total_norm) gets a thin function in front of its replacement: sharded gradients go to
torch's own clip_grad_norm_, everything else to the vendor's. All of it is installed by the first
shard() and put back by shutdown() and process_state.reset(), as the optimizer step hooks are.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch
import torch.nn.utils as nn_utils
import torch.nn.utils.clip_grad as clip_grad_module

from ...errors import ShardkitError
from . import param_access
from ..step.whole_view import local_of

_ORIGINAL_TOTAL_NORM: Callable[..., torch.Tensor] = clip_grad_module._get_total_norm
_TORCH_CLIP: Callable[..., torch.Tensor] = clip_grad_module.clip_grad_norm_
_installed = False
# A vendor library may have replaced torch.nn.utils.clip_grad_norm_ with its own, which never
# reaches _get_total_norm (a lazy-tensor one that avoids host syncs does): that replacement,
# while clip_grad_norm_over_shards stands in front of it.
_replaced_clip: Callable[..., torch.Tensor] | None = None


def install() -> None:
    """Route torch's total-norm computation through shard-aware norms (idempotent)."""
    global _installed, _replaced_clip
    if _installed:
        return
    clip_grad_module._get_total_norm = total_norm
    nn_utils.get_total_norm = total_norm
    if nn_utils.clip_grad_norm_ is not _TORCH_CLIP:
        _replaced_clip = nn_utils.clip_grad_norm_
        nn_utils.clip_grad_norm_ = clip_grad_norm_over_shards
    _installed = True


def uninstall() -> None:
    """Give torch its own total-norm function back (shutdown(), process_state.reset)."""
    global _installed, _replaced_clip
    if not _installed:
        return
    if clip_grad_module._get_total_norm is total_norm:
        clip_grad_module._get_total_norm = _ORIGINAL_TOTAL_NORM
    if getattr(nn_utils, "get_total_norm", None) is total_norm:
        nn_utils.get_total_norm = _ORIGINAL_TOTAL_NORM
    if _replaced_clip is not None and nn_utils.clip_grad_norm_ is clip_grad_norm_over_shards:
        nn_utils.clip_grad_norm_ = _replaced_clip
    _replaced_clip = None
    _installed = False


def clip_grad_norm_over_shards(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float,
                               norm_type: float = 2.0, error_if_nonfinite: bool = False,
                               foreach: bool | None = None) -> torch.Tensor:
    """torch's own clip_grad_norm_ for sharded gradients; the vendor's replacement for the rest."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    owners = param_access.grad_owners()
    if any(p.grad is not None and id(p.grad) in owners for p in params):
        return _TORCH_CLIP(params, max_norm, norm_type, error_if_nonfinite, foreach)
    assert _replaced_clip is not None  # installed only in front of a replacement
    return _replaced_clip(params, max_norm, norm_type, error_if_nonfinite, foreach)


def _per_tensor_norms(tensors: list[torch.Tensor], norm_type: float,
                      foreach: bool | None) -> list[torch.Tensor]:
    """Each tensor's own norm, with torch's foreach kernel where it applies."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    norms: list[torch.Tensor | None] = [None] * len(tensors)
    for (device, _), idx in groups.items():
        group = [tensors[i] for i in idx]
        if foreach is not False and _foreach_works(device):
            values = list(torch._foreach_norm(group, norm_type))
        elif foreach:
            raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on "
                               f"{device.type} tensors")
        else:
            values = [torch.linalg.vector_norm(g, norm_type) for g in group]
        for i, value in zip(idx, values):
            norms[i] = value
    return [n for n in norms if n is not None]


def _foreach_works(device: torch.device) -> bool:
    from torch.utils._foreach_utils import _device_has_foreach_support

    return bool(_device_has_foreach_support(device))


def _whole_norms(local: list[torch.Tensor], norm_type: float, state: Any,
                 tp_group: Any = None) -> list[torch.Tensor]:
    """The whole parameters' norms from this rank's row norms: one collective over the shard
    group, and one over tensor parallelism's group where TP splits the parameters too."""
    device = state.device
    values = torch.stack([n.to(device, torch.float32) for n in local])
    groups = [g for g in (state.shard_group, tp_group) if g is not None and g.size > 1]
    backend = state.backend
    if math.isinf(norm_type):
        # Collectives are asked only for sums, so gather every rank's maxima and reduce here.
        for group in groups:
            everyone = torch.empty(group.size * values.numel(), dtype=torch.float32, device=device)
            backend.collectives.all_gather_into_tensor(everyone, values.contiguous(), group).wait()
            values = everyone.view(group.size, -1).amax(dim=0)
        whole = values
    elif norm_type == 0:  # a count of non-zero elements adds up across rows
        for group in groups:
            backend.collectives.all_reduce(values, group, op="sum").wait()
        whole = values
    else:
        powered = values.pow(norm_type)
        for group in groups:
            backend.collectives.all_reduce(powered, group, op="sum").wait()
        whole = powered.pow(1.0 / norm_type)
    return [w.to(n.device, n.dtype) for w, n in zip(whole.unbind(0), local)]


def counted_rows(grad: torch.Tensor, sp: Any, state: Any) -> torch.Tensor:
    """The rows of a shard's gradient this rank counts in a norm: its own rows (a DTensor's local
    tensor; zero padding adds nothing), one zero where it has none (an inf-norm kernel refuses an
    empty tensor), and nothing of a replicated 0-d parameter except on shard rank 0 (each rank
    holds all of it)."""
    rows = local_of(grad).detach()
    if rows.numel() == 0 or (sp.replicated_scalar and state.shard_group.rank != 0):
        return rows.new_zeros(1)
    return rows


def _counted(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[Any]]:
    """Each tensor as a norm counts it (counted_rows for a shard's gradient) and its owner
    (engine state, TP group) (None: not a shard's gradient)."""
    by_grad = param_access.grad_owners()
    counted, owners = [], []
    for t in tensors:
        found = by_grad.get(id(t))
        counted.append(t if found is None else counted_rows(t, found[1], found[0]))
        owners.append(None if found is None else (found[0], found[1].tp_group))
    return counted, owners


@torch.no_grad()
def total_norm(tensors: torch.Tensor | Iterable[torch.Tensor], norm_type: float = 2.0,
               error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    """torch.nn.utils.get_total_norm, with sharded gradients counted as the whole parameters'."""
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    counted, owners = _counted(tensors)
    return total_norm_of(counted, owners, norm_type, error_if_nonfinite, foreach)


def total_norm_of(tensors: list[torch.Tensor], owners: list[Any], norm_type: float = 2.0,
                  error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    """total_norm with each tensor's owner given: (engine state, tensor parallelism's group
    where TP splits the parameter, else None), or None for a gradient that is not a shard's."""
    if not any(owner is not None for owner in owners):
        return _ORIGINAL_TOTAL_NORM(tensors, norm_type, error_if_nonfinite, foreach)
    norm_type = float(norm_type)
    if norm_type < 0:
        raise ShardkitError(f"a gradient norm of order {norm_type} over sharded gradients is not "
                            "supported (a negative order is a minimum, and a shard's zero padding "
                            "rows would decide it). HINT: use a positive norm_type, or 'inf'")
    norms = _per_tensor_norms(tensors, norm_type, foreach)
    by_groups: dict[tuple[int, int], tuple[Any, list[int]]] = {}
    for i, owner in enumerate(owners):
        if owner is not None:
            by_groups.setdefault((id(owner[0]), id(owner[1])), (owner, []))[1].append(i)
    for (state, tp_group), idx in by_groups.values():
        for i, whole in zip(idx, _whole_norms([norms[i] for i in idx], norm_type, state,
                                              tp_group)):
            norms[i] = whole
    first_device = tensors[0].device
    total = torch.linalg.vector_norm(torch.stack([n.to(first_device) for n in norms]), norm_type)
    if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
            "so it cannot be clipped. To disable this error and scale the gradients by the "
            "non-finite norm anyway, set `error_if_nonfinite=False`")
    return total
