"""One original parameter under sharding: its 1-D padded master shard and its gathered full tensor.

Layout: the parameter is flattened and right-padded to `padded_numel`, a multiple of
shard_group.size * alignment; rank r of the shard group owns elements [r*shard_numel, (r+1)*shard_numel).
The sharded nn.Parameter (what the optimizer owns) is registered on the owning module(s) outside
forward/backward; the unsharded nn.Parameter (full shape, compute dtype) is registered while the
unit computes. The unsharded one is the same Python object for the whole run, so tensors autograd
saved in forward see the data again once it is re-gathered for backward.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..backend import Backend
from ..handles import Group


# Parameters at least this large get their own collectives straight into / out of their padded
# flat storage: for them the copy between the flat bucket and the parameter costs as much as the
# collective, while one more small collective per parameter costs next to nothing.
DIRECT_MIN_NUMEL = 1 << 20


class ShardedParam:
    """Per-parameter state: names, shapes, the owned shard and the (re)gathered full tensor."""

    def __init__(self, fqns: list[str], owners: list[tuple[nn.Module, str]], orig: nn.Parameter,
                 shard_group: Group, alignment: int, shard_device: torch.device,
                 compute_device: torch.device, compute_dtype: torch.dtype, backend: Backend) -> None:
        self.fqns = fqns  # every name this parameter has (more than one when tied inside a unit)
        self.owners = owners  # (module, attribute) pairs to register the parameter on
        self.full_shape = orig.shape
        self.numel = orig.numel()
        self.master_dtype = orig.dtype
        self.compute_dtype = compute_dtype
        self.compute_device = compute_device
        self.requires_grad = orig.requires_grad
        self._backend = backend
        self.group_size = shard_group.size
        chunk = shard_group.size * max(1, alignment)
        self.padded_numel = max(1, math.ceil(self.numel / chunk)) * chunk
        self.shard_numel = self.padded_numel // shard_group.size
        self.offset = shard_group.rank * self.shard_numel
        self.valid_numel = max(0, min(self.shard_numel, self.numel - self.offset))
        self.sharded = nn.Parameter(
            torch.zeros(self.shard_numel, dtype=self.master_dtype, device=shard_device),
            requires_grad=orig.requires_grad)
        self.is_meta = orig.device.type == "meta"
        if not self.is_meta:
            self.load_full(orig.detach())
        # A direct parameter's unsharded tensor is a view of its padded flat storage, which is
        # exactly one all-gather output (rank-major shards of one parameter); freeing and
        # re-allocating that storage keeps both views (and autograd's saved ones) valid.
        self.direct = (backend.capabilities.supports_storage_resize
                       and self.numel >= DIRECT_MIN_NUMEL)
        flat = torch.empty(self.padded_numel if self.direct else 0,
                           dtype=compute_dtype, device=compute_device)
        full = (flat[:self.numel].view(self.full_shape) if self.direct
                else torch.empty(self.full_shape, dtype=compute_dtype, device=compute_device))
        self.unsharded = nn.Parameter(full, requires_grad=orig.requires_grad)
        # `.data`: a separate version counter, so re-gathering for backward does not look like
        # an in-place edit of the tensor autograd saved in forward (as copy-out into .data did).
        self.unsharded_flat = flat.data
        self.free_unsharded()

    @property
    def fqn(self) -> str:
        """The first (state_dict-order) name of this parameter."""
        return self.fqns[0]

    def rank_valid(self, group_rank: int) -> int:
        """How many real (non-padding) elements group rank `group_rank` holds."""
        return max(0, min(self.shard_numel, self.numel - group_rank * self.shard_numel))

    # ---- the master shard ------------------------------------------------------------------
    def load_full(self, full: torch.Tensor) -> None:
        """Copy this rank's slice of a full tensor into the shard in place; padding becomes zero."""
        if tuple(full.shape) != tuple(self.full_shape):
            from ..errors import ShardkitError

            raise ShardkitError(f"parameter {self.fqn!r} has shape {tuple(self.full_shape)} but the "
                                f"tensor given has shape {tuple(full.shape)}")
        flat = full.reshape(-1)
        with torch.no_grad():
            self.sharded.data.zero_()
            if self.valid_numel:
                self.sharded.data[:self.valid_numel].copy_(
                    flat[self.offset:self.offset + self.valid_numel])

    def accumulate_grad(self, grad: torch.Tensor) -> None:
        """Add a reduced gradient shard to the sharded parameter's .grad (creating it if absent)."""
        if self.sharded.grad is None:
            # A view of the reduce output is fine: that buffer is exactly the shards, per step.
            self.sharded.grad = grad.to(device=self.sharded.device, dtype=self.sharded.dtype)
        else:
            self.sharded.grad.add_(grad)

    # ---- the gathered full tensor ------------------------------------------------------------
    def alloc_unsharded(self) -> None:
        """Give the unsharded parameter memory for its full shape (values are filled by copy-out)."""
        if self.direct:
            self._backend.alloc_storage(self.unsharded_flat)  # the padded size, not just numel
        elif self._backend.capabilities.supports_storage_resize:
            self._backend.alloc_storage(self.unsharded)
        else:
            # No storage to resize (lazy tensors): swap in a fresh tensor under the same Parameter.
            self.unsharded.data = torch.empty(self.full_shape, dtype=self.compute_dtype,
                                              device=self.compute_device)

    def free_unsharded(self) -> None:
        """Drop the unsharded parameter's memory while keeping the object autograd refers to."""
        if self._backend.capabilities.supports_storage_resize:
            self._backend.free_storage(self.unsharded)
        else:
            self.unsharded.data = torch.empty(0, dtype=self.compute_dtype, device=self.compute_device)

    def take_unsharded_grad(self) -> torch.Tensor | None:
        """Return and detach the gradient autograd accumulated on the unsharded parameter."""
        grad = self.unsharded.grad
        self.unsharded.grad = None
        return grad

    def register(self, unsharded: bool) -> None:
        """Put the unsharded (compute) or sharded (optimizer) parameter on every owning module."""
        param = self.unsharded if unsharded else self.sharded
        for module, name in self.owners:
            module._parameters[name] = param
