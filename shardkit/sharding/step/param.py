"""One original parameter under sharding: its master shard (whole rows) and its gathered full tensor.

Layout (sharding/step/layout.py): the parameter is split along dim 0 into `rows_per_rank` rows per
rank of the shard group, padded with rows at the end. The shard keeps the parameter's
dimensions (a (32, 16) weight is a (rows_per_rank, 16) tensor) because training scripts branch
on them: a weight-decay rule on `p.dim() >= 2` silently decays nothing when shards are 1-D.
Flattened, rank r's shard is elements [r*shard_numel, (r+1)*shard_numel) of the row-major,
right-padded parameter, so every collective works on flat views as before.
The engine keeps each shard as that plain padded tensor (`local`); the sharded nn.Parameter (what
the optimizer owns) is what the parameter's form makes of it (sharding/step/whole_view.py, chosen
once at shard()): a DTensor of the whole parameter whose local tensor is a view of `local`'s real
rows wherever a DeviceMesh exists (torch's idioms then see whole parameters), the padded rows
themselves on a backend without one (XLA). It is registered on the owning module(s) outside
forward/backward; the unsharded nn.Parameter (full shape, compute dtype) is registered while the
unit computes. The unsharded one is the same Python object for the whole run, so tensors autograd
saved in forward see the data again once it is re-gathered for backward.

A parameter torch's tensor parallelism already made a DTensor (`parallelize_module` on another
dimension of the user's mesh) is sharded the same way, from its local tensor: the engine's
"full" tensor is this rank's tensor-parallel part, split into rows over the data-parallel group;
the gathered parameter the module computes with is the DTensor tensor parallelism made (on its
mesh, with its placements, over the gathered part), so TP's own collectives stay TP's; its
gradient is brought to those placements (a Partial one summed over TP) before the data-parallel
reduction; and the user's parameter is a DTensor on both dimensions (whole_view.tp_whole_spec).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...backend import Backend
from ...handles import Group
from .layout import shard_layout
from .whole_view import ParamForm, is_dtensor, local_of, whole, with_dtype


class ShardedParam:
    """Per-parameter state: names, shapes, the owned shard and the (re)gathered full tensor."""

    def __init__(self, fqns: list[str], owners: list[tuple[nn.Module, str]], orig: nn.Parameter,
                 shard_group: Group, alignment: int, shard_device: torch.device,
                 compute_device: torch.device, compute_dtype: torch.dtype, backend: Backend,
                 form: ParamForm) -> None:
        self.fqns = fqns  # every name this parameter has (more than one when tied inside a unit)
        self.owners = owners  # (module, attribute) pairs to register the parameter on
        # Tensor parallelism's layout of the parameter (None for a plain one): the engine shards
        # its local part, and the module computes with a DTensor of that layout.
        self.tp_spec = orig._spec if is_dtensor(orig) else None  # type: ignore[attr-defined]
        self.whole_shape = orig.shape  # what the user's parameter reports (TP's global shape)
        # Where TP splits the parameter, the group a whole-parameter reduction (a norm) also spans.
        self.tp_group = None if self.tp_spec is None else tp_split_group(self.tp_spec)
        if self.tp_spec is not None:
            orig = nn.Parameter(orig._local_tensor, requires_grad=orig.requires_grad)  # type: ignore[attr-defined]
        self.full_shape = orig.shape
        self.numel = orig.numel()
        self.master_dtype = orig.dtype
        self.compute_dtype = compute_dtype
        self.compute_device = compute_device
        self.requires_grad = orig.requires_grad
        self._backend = backend
        self.group_size = shard_group.size
        layout = shard_layout(orig.shape, shard_group.size, form.alignment(alignment))
        self.padded_numel, self.shard_numel = layout.padded_numel, layout.shard_numel
        self.shard_shape = torch.Size(layout.shard_shape)
        self.offset = shard_group.rank * self.shard_numel
        self.valid_numel = max(0, min(self.shard_numel, self.numel - self.offset))
        rows = self.full_shape[0] if self.full_shape else 1
        self.first_row = shard_group.rank * layout.rows_per_rank  # of the full tensor's dim 0
        self.valid_rows = max(0, min(layout.rows_per_rank, rows - self.first_row))
        self.form = form
        self._placements = form.placements(len(self.full_shape))
        self._specs: dict[torch.dtype, Any] = {}  # the DTensorSpec per dtype (state may differ)
        # Replicated, a 0-d parameter's value is on every rank of its group, not rank 0 alone.
        self.replicated_scalar = form.replicates_scalars() and not self.full_shape
        # The engine's shard: padded rows, what collectives read and the optimizer's updates land in.
        self.local = torch.zeros(self.shard_shape, dtype=self.master_dtype, device=shard_device)
        self.sharded = nn.Parameter(self.as_user(self.local), requires_grad=orig.requires_grad)
        if self.tp_spec is not None:
            check_tp_layout(self.fqn, self.sharded, self.whole_shape)
        self.is_meta = orig.device.type == "meta"
        if not self.is_meta:
            self.load_full(orig.detach())
        # The unsharded tensor is a view of a padded flat buffer laid out exactly like the
        # parameter's columns of an all-gather output (rank-major shards), so copy-out is one
        # fused split for the whole unit. Freeing and re-allocating the buffer's storage keeps
        # both views (and the ones autograd saved) valid.
        flat = torch.empty(self.padded_numel, dtype=compute_dtype, device=compute_device)
        gathered = flat[:self.numel].view(self.full_shape)
        if self.tp_spec is not None:  # what tensor parallelism's modules compute with
            gathered = whole(gathered, with_dtype(self.tp_spec, compute_dtype))
        self.unsharded = nn.Parameter(gathered, requires_grad=orig.requires_grad)
        # `.data`: a separate version counter, so re-gathering for backward does not look like
        # an in-place edit of the tensor autograd saved in forward.
        self.unsharded_flat = flat.data
        self.free_unsharded()

    @property
    def fqn(self) -> str:
        """The first (state_dict-order) name of this parameter."""
        return self.fqns[0]

    @property
    def user_shape(self) -> torch.Size:
        """The shape of the sharded parameter's own rows (a DTensor's local tensor: no padding)."""
        return self.user_rows(torch.empty(self.shard_shape, device="meta")).shape

    def as_user(self, rows: torch.Tensor) -> torch.Tensor:
        """What training code gets for a shard-shaped tensor, made by the parameter's form: a
        DTensor over its real rows (no copy), or the padded rows themselves."""
        if rows.dtype not in self._specs:
            self._specs[rows.dtype] = (
                self.form.spec(self._placements, self.full_shape, rows.dtype)
                if self.tp_spec is None else self.form.tp_spec(self._placements, self.tp_spec,
                                                               rows.dtype))
        return self.form.as_user(self.user_rows(rows), self._specs[rows.dtype])

    def as_rows(self, value: torch.Tensor) -> torch.Tensor:
        """The shard-shaped (padded) rows of a tensor laid out like the sharded parameter (its
        .grad, optimizer state): a DTensor's local rows, zero-padded (a view where none are
        missing); a plain shard-shaped tensor is returned as it is."""
        rows = local_of(value)
        if tuple(rows.shape) == tuple(self.shard_shape):
            return rows
        out = torch.zeros(self.shard_shape, dtype=rows.dtype, device=rows.device)
        out[:rows.shape[0]].copy_(rows)
        return out

    def rank_valid(self, group_rank: int) -> int:
        """How many real (non-padding) elements group rank `group_rank` holds."""
        return max(0, min(self.shard_numel, self.numel - group_rank * self.shard_numel))

    # ---- the master shard ------------------------------------------------------------------
    def shard_flat(self) -> torch.Tensor:
        """The master shard as a flat (shard_numel,) view, outside autograd: what collectives read."""
        return self.local.reshape(-1)

    def load_full(self, full: torch.Tensor) -> None:
        """Copy this rank's slice of a full tensor into the shard in place; padding becomes zero."""
        if self.tp_spec is not None and is_dtensor(full):
            full = local_of(full)  # the gathered tensor-parallel part: the engine's whole
        if tuple(full.shape) != tuple(self.full_shape):
            from ...errors import ShardkitError

            raise ShardkitError(f"parameter {self.fqn!r} has shape {tuple(self.full_shape)} but the "
                                f"tensor given has shape {tuple(full.shape)}")
        with torch.no_grad():
            self._copy_mine(full, self.local)  # the parameter's rows are views of it

    def row_span(self) -> tuple[int, int] | None:
        """The rows [start, stop) of the full tensor's dim 0 this rank holds; None: the whole
        tensor (a 0-d parameter, which every rank of a mesh holds)."""
        if not self.full_shape:
            return None
        return self.first_row, self.first_row + self.valid_rows

    def load_rows(self, rows: torch.Tensor) -> None:
        """Copy this rank's rows (row_span() of the full tensor, read alone) into the shard in
        place; padding becomes zero."""
        span = self.row_span()
        if span is None:
            self.load_full(rows)
            return
        expected = (span[1] - span[0], *self.full_shape[1:])
        if tuple(rows.shape) != expected:
            from ...errors import ShardkitError

            raise ShardkitError(f"parameter {self.fqn!r}: rows {span[0]}:{span[1]} of shape "
                                f"{expected} expected, got {tuple(rows.shape)}")
        with torch.no_grad():
            _fill(self.local, rows.detach().reshape(-1))

    def rows_of(self, full: torch.Tensor, device: torch.device) -> torch.Tensor:
        """This rank's rows of a full tensor, shaped like the shard with zero padding rows (a new tensor)."""
        out = torch.empty(self.shard_shape, dtype=full.dtype, device=device)
        self._copy_mine(full, out)
        return out

    def _copy_mine(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        """Fill a shard-shaped tensor with this rank's elements of `full`; padding becomes zero."""
        flat = full.detach().reshape(-1)
        _fill(shard, flat if self.replicated_scalar
              else flat[self.offset:self.offset + self.valid_numel])

    def accumulate_grad(self, grad: torch.Tensor) -> None:
        """Add a reduced flat gradient shard to the sharded parameter's .grad (creating it if absent)."""
        grad = grad.view(self.shard_shape).to(device=self.local.device, dtype=self.local.dtype)
        if self.sharded.grad is None:
            # A view of the reduce output is fine: that buffer is exactly the shards, per step.
            self.sharded.grad = self.as_user(grad)
        else:
            local_of(self.sharded.grad).add_(self.user_rows(grad))

    def user_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The part of shard-shaped `rows` the sharded parameter covers (a DTensor's real rows)."""
        return self.form.user_rows(rows, self.valid_rows, len(self.full_shape))

    # ---- the gathered full tensor ------------------------------------------------------------
    def alloc_unsharded(self) -> None:
        """Give the padded flat buffer (and so the unsharded parameter) memory; copy-out fills it."""
        if self._backend.capabilities.supports_storage_resize:
            self._backend.devices.alloc_storage(self.unsharded_flat)  # the padded size, not just numel
        else:
            # No storage to resize (lazy tensors): swap in a fresh buffer under the same Parameter.
            self.unsharded_flat = torch.empty(self.padded_numel, dtype=self.compute_dtype,
                                              device=self.compute_device)
            self.unsharded.data = self.unsharded_flat[:self.numel].view(self.full_shape)

    def free_unsharded(self) -> None:
        """Drop the unsharded parameter's memory while keeping the object autograd refers to."""
        if self._backend.capabilities.supports_storage_resize:
            self._backend.devices.free_storage(self.unsharded_flat)
        else:
            self.unsharded_flat = torch.empty(0, dtype=self.compute_dtype, device=self.compute_device)
            self.unsharded.data = torch.empty(0, dtype=self.compute_dtype, device=self.compute_device)

    def take_unsharded_grad(self) -> torch.Tensor | None:
        """Return and detach the gradient autograd accumulated on the unsharded parameter."""
        grad = self.unsharded.grad
        self.unsharded.grad = None
        if grad is not None and self.tp_spec is not None:
            if tuple(grad.placements) != tuple(self.tp_spec.placements):  # type: ignore[attr-defined]
                # (a SequenceParallel weight's gradient is Partial over TP: summed there first)
                grad = grad.redistribute(placements=self.tp_spec.placements)  # type: ignore[attr-defined]
            grad = local_of(grad)
        return grad

    def register(self, unsharded: bool) -> None:
        """Put the unsharded (compute) or sharded (optimizer) parameter on every owning module."""
        param = self.unsharded if unsharded else self.sharded
        for module, name in self.owners:
            module._parameters[name] = param


def check_tp_layout(fqn: str, param: Any, whole_shape: torch.Size) -> None:
    """Raise where the rows this rank keeps of TP's part are not the local tensor torch's DTensor
    layout gives it: every idiom reading the parameter (full_tensor, norms, checkpoints) would
    then put values in the wrong places, silently."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    spec = param._spec
    expected, _ = compute_local_shape_and_global_offset(whole_shape, spec.mesh, spec.placements)
    if tuple(expected) != tuple(param._local_tensor.shape):
        from ...errors import ShardkitError

        raise ShardkitError(
            f"parameter {fqn!r} of shape {tuple(whole_shape)}: this rank keeps "
            f"{tuple(param._local_tensor.shape)} of tensor parallelism's part, where torch lays "
            f"{spec.placements} out as {tuple(expected)}. HINT: make its dimension 0 a multiple of "
            "the data-parallel x tensor-parallel size")


def tp_split_group(spec: Any) -> Group | None:
    """Tensor parallelism's group of a parameter it splits (None where TP replicates it)."""
    if not any(p.is_shard() for p in spec.placements):
        return None
    import torch.distributed as dist

    handle = spec.mesh.get_group(0)
    ranks = tuple(dist.get_process_group_ranks(handle))
    return Group(spec.mesh.get_local_rank(0), len(ranks), ranks, handle)


def _fill(shard: torch.Tensor, mine: torch.Tensor) -> None:
    """Copy this rank's elements into the front of a shard-shaped tensor; the padding is zeroed."""
    flat = shard.view(-1)
    flat.zero_()
    if mine.numel():
        flat[:mine.numel()].copy_(mine)
