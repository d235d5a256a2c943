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
  Beside tensor parallelism a parameter's elements are a rectangular ``block`` ((offsets, sizes)
  per dimension) of the whole tensor, not whole rows: ``local.view(-1)[:valid_numel]`` holds
  that block row-major, ``full_shape`` is TP's global shape, and ``writes`` says whether this
  rank writes it (one rank per distinct block: TP's replicas of a parameter it did not split
  write once).
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
from ..step.whole_view import full_of


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
    block: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # TP: this rank's block
    tp_writer: bool = True  # False on TP's copies of a parameter TP did not split


def shard_views(module: nn.Module) -> list[ShardView]:
    """Every sharded parameter of a module returned by shardkit.shard(), in state_dict order."""
    state = get_state(module)
    by_fqn = state.params_by_fqn()
    views = []
    for fqn in module.state_dict(keep_vars=True):
        sp = by_fqn.get(fqn)
        if sp is None:
            continue  # a buffer
        block, writer = _tp_block(sp)
        views.append(ShardView(fqn, sp.whole_shape, sp.master_dtype, sp.sharded, sp.local,
                               sp.as_rows, sp.as_user, sp.shard_numel,
                               sp.offset, sp.valid_numel, state.shard_group, state.replica_group,
                               sp.requires_grad, sp.replicated_scalar, block, writer))
    return views


def _tp_block(sp: ShardedParam) -> tuple[tuple[tuple[int, ...], tuple[int, ...]] | None, bool]:
    """(this rank's block of the whole tensor, whether it writes it) for a tensor-parallel
    parameter, as torch lays out its DTensor; (None, True) for any other."""
    if sp.tp_spec is None:
        return None, True
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    spec = sp.sharded._spec  # type: ignore[attr-defined]
    shape, offset = compute_local_shape_and_global_offset(sp.whole_shape, spec.mesh,
                                                          spec.placements)
    # Where TP did not split it, TP's ranks hold the same block: the first of them writes it.
    writer = sp.tp_group is not None or sp.tp_spec.mesh.get_local_rank(0) == 0
    return (tuple(offset), tuple(shape)), writer


def iter_unit_full_params(module: nn.Module) -> Iterator[tuple[list[str], dict[str, torch.Tensor]]]:
    """Collective: yield (fqns, {fqn: full master-dtype tensor}) unit by unit; memory freed on advance."""
    state = get_state(module)
    for unit in state.units:
        fulls: dict[str, torch.Tensor] = {}
        if any(sp.tp_spec is not None for sp in unit.params):
            # Beside tensor parallelism the whole tensor spans both dimensions: DTensor gathers it.
            for sp in unit.params:
                full = full_of(sp.sharded.detach())
                fulls.update({fqn: full for fqn in sp.fqns})
            yield [fqn for sp in unit.params for fqn in sp.fqns], fulls
            del fulls
            continue
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
    sp = _sharded_param(module, fqn)
    _refuse_tensor_parallel(sp, "loading a full tensor")
    sp.load_full(full.detach())


def load_param_rows_(module: nn.Module, fqn: str,
                     read: Callable[[tuple[int, int] | None], torch.Tensor]) -> None:
    """Fill the sharded parameter with this rank's rows of a full tensor, asking `read` for just
    those rows (`read(None)`: the whole tensor, for a 0-d parameter); no communication."""
    sp = _sharded_param(module, fqn)
    _refuse_tensor_parallel(sp, "loading a full state dict")
    sp.load_rows(read(sp.row_span()))


def _refuse_tensor_parallel(sp: ShardedParam, what: str) -> None:
    if sp.tp_spec is not None:
        raise ShardkitError(
            f"{what} into a tensor-parallel parameter ({sp.fqn!r}, a DTensor of "
            "parallelize_module) is not supported yet: its rows are not this rank's piece. HINT: "
            "torch.distributed.checkpoint.state_dict.set_model_state_dict(model, full_state_dict, "
            "options=StateDictOptions(full_state_dict=True)) loads whole tensors into both "
            "dimensions")


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
