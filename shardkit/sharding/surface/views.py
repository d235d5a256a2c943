"""The engine <-> checkpoint contract: what a sharded model exposes to shardkit.checkpoint.

Checkpointing reads and writes a sharded model only through these five names, so the engine's
internals can change without touching checkpoint code:

- ``ShardView`` (frozen): one parameter as checkpointing sees it. ``fqn`` is its state_dict name;
  ``full_shape``/``dtype`` the original tensor; ``param`` the sharded nn.Parameter the
  optimizer steps (its state is keyed by it: a DTensor of the whole parameter, or plain rows);
  ``local`` the engine's padded rows of it (whole rows of the original with its dimensions):
  this rank holds elements ``[offset, offset + valid_numel)`` of the flattened full tensor in
  ``local.view(-1)[:valid_numel]``, the rest of its ``shard_numel`` elements being zero
  padding; ``as_rows``/``as_user`` turn optimizer state laid out like ``param`` into such
  padded rows and back; ``shard_group``/``replica_group`` say which ranks hold the other
  slices (replica None: no replication); ``replicated``: a 0-d parameter every rank of its shard
  group holds (and so loads), which shard rank 0 alone writes; tied names give one view each.
- ``shard_views(model)``: every view, in state_dict order (buffers are not included: they are
  full and replicated, and read from the module as usual).
- ``iter_unit_full_params(model)``: collective; yields ``(fqns, {fqn: full tensor})`` one unit at
  a time, in master dtype; a unit's tensors are freed when the iterator advances.
- ``load_full_param_(model, fqn, full)``: copies this rank's slice of a full tensor into the shard,
  no communication; refuses a name that is not a sharded parameter. ``load_param_rows_(model,
  fqn, read)`` does the same reading only this rank's rows (``read((start, stop))``: a file
  slice), so a rank never holds more of a large tensor than its own rows.
- ``sharding_info(model)``: ``world_size``, ``strategy``, ``shard_group_size``,
  ``replica_group_size``, recorded in checkpoint manifests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn

from ...errors import ShardkitError
from ...handles import Group
from ..step.comms import gather_exact
from .module_api import get_state
from ..step.param import ShardedParam
from ..step.state import ShardState


@dataclass(frozen=True)
class ShardView:
    """How one parameter is split: its names, shapes, and this rank's slice."""

    fqn: str
    full_shape: torch.Size
    dtype: torch.dtype
    param: nn.Parameter
    local: torch.Tensor
    as_rows: Callable[[torch.Tensor], torch.Tensor]
    as_user: Callable[[torch.Tensor], torch.Tensor]
    shard_numel: int
    offset: int
    valid_numel: int
    shard_group: Group
    replica_group: Group | None
    requires_grad: bool
    replicated: bool = False  # a 0-d DTensor parameter: every rank of the shard group holds it


def refuse_tensor_parallel(state: ShardState, what: str) -> None:
    """Raise for a model with tensor-parallel parameters: `what` reads whole tensors by the
    data-parallel rows alone, which would hold or write only this rank's TP part as if whole."""
    tp = next((sp.fqn for sp in state.iter_params() if sp.tp_spec is not None), None)
    if tp is not None:
        raise ShardkitError(
            f"{what} does not handle tensor-parallel parameters yet ({tp!r} is a DTensor of "
            "parallelize_module): it would see only this rank's tensor-parallel part of each. "
            "HINT: use torch's state-dict API, which sees both dimensions: "
            "torch.distributed.checkpoint.state_dict.get_model_state_dict(model) with dcp.save / "
            "dcp.load, or StateDictOptions(full_state_dict=True) for whole tensors")


def shard_views(module: nn.Module) -> list[ShardView]:
    """Every sharded parameter of a module returned by shardkit.shard(), in state_dict order."""
    state = get_state(module)
    refuse_tensor_parallel(state, "shardkit's checkpoint (save, load, export, full_state_dict)")
    by_fqn = state.params_by_fqn()
    views = []
    for fqn in module.state_dict(keep_vars=True):
        sp = by_fqn.get(fqn)
        if sp is None:
            continue  # a buffer
        views.append(ShardView(fqn, sp.full_shape, sp.master_dtype, sp.sharded, sp.local,
                               sp.as_rows, sp.as_user, sp.shard_numel,
                               sp.offset, sp.valid_numel, state.shard_group, state.replica_group,
                               sp.requires_grad, sp.replicated_scalar))
    return views


def iter_unit_full_params(module: nn.Module) -> Iterator[tuple[list[str], dict[str, torch.Tensor]]]:
    """Collective: yield (fqns, {fqn: full master-dtype tensor}) unit by unit; memory freed on advance."""
    state = get_state(module)
    refuse_tensor_parallel(state, "iter_unit_full_params")
    for unit in state.units:
        fulls: dict[str, torch.Tensor] = {}
        by_dtype: dict[torch.dtype, list[ShardedParam]] = {}
        for sp in unit.params:
            by_dtype.setdefault(sp.master_dtype, []).append(sp)
        for dtype, params in by_dtype.items():
            for sp, full in zip(params, gather_exact(params, dtype, state.shard_group,
                                                     state.backend, state.device, state.stats)):
                for fqn in sp.fqns:
                    fulls[fqn] = full
        fqns = [fqn for sp in unit.params for fqn in sp.fqns]
        yield fqns, fulls
        del fulls


def load_full_param_(module: nn.Module, fqn: str, full: torch.Tensor) -> None:
    """Copy this rank's slice of a full tensor into the sharded parameter in place (no communication)."""
    _sharded_param(module, fqn).load_full(full.detach())


def load_param_rows_(module: nn.Module, fqn: str,
                     read: Callable[[tuple[int, int] | None], torch.Tensor]) -> None:
    """Fill the sharded parameter with this rank's rows of a full tensor, asking `read` for just
    those rows (`read(None)`: the whole tensor, for a 0-d parameter); no communication."""
    sp = _sharded_param(module, fqn)
    sp.load_rows(read(sp.row_span()))


def _sharded_param(module: nn.Module, fqn: str) -> ShardedParam:
    sp = get_state(module).params_by_fqn().get(fqn)
    if sp is None:
        raise ShardkitError(f"{fqn!r} is not a sharded parameter of this model; HINT: names are "
                            "those of the original model's state_dict() (buffers are not sharded)")
    return sp


def sharding_info(module: nn.Module) -> dict:
    """{"world_size", "strategy", "shard_group_size", "replica_group_size"} of a sharded model."""
    state = get_state(module)
    return {"world_size": state.world.size, "strategy": state.strategy_name,
            "shard_group_size": state.shard_group.size,
            "replica_group_size": state.replica_group.size if state.replica_group else 1}
