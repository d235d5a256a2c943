"""What training code sees of a shard: a DTensor of the whole parameter, so torch's idioms add up.

A shard is this rank's rows of a parameter. Handed to torch as a plain tensor, every utility
that reduces over parameters answers for this rank's slice alone, with no error:
`sum(p.numel() ...)`, `p.grad.norm()`, `parameters_to_vector`, torch's `clip_grad_norm_`,
`state_dict()` (issue 40). Presented as a DTensor (torch's own sharded tensor, what FSDP2's
parameters are), the same calls give the whole parameter's answer: shapes and `numel()` are the
full ones, reductions run the collective they need, `full_tensor()` gathers.

The engine itself never works through the DTensor: it keeps each shard as a plain padded tensor
of `rows_per_rank` rows (ShardedParam.local), which every collective reads and writes, and the
DTensor's local tensor is a view of that tensor's real rows. The layouts agree because shardkit's
row split is torch.chunk's (ceil(rows / N) rows per rank, the last ranks short or empty), which is
what DTensor's Shard(0) means; a backend alignment that would widen the rows is not applied on
this route (sharding/step/layout.py).

Where the DTensor route applies (`make_mesh`): shard groups of more than one rank on a backend
whose collectives run on torch.distributed process groups (a DeviceMesh is built from them), with
the shards on the compute device's type (a DTensor's collectives run on its mesh's device type).
Elsewhere parameters stay plain rows: one rank per shard group (NO_SHARD, a world of one) already
holds whole parameters; a backend without torch process groups (XLA's device threads) has no
mesh, and there torch's clip_grad_norm_ is covered by sharding/surface/torch_norms.py and the other
idioms need shardkit.full_shape / full_tensor.

HYBRID_SHARD's mesh has two dimensions, (replicas, shard group): rows are Shard(0) inside a shard
group and Replicate() across replicas. A 0-d parameter cannot be split by rows: it is
Replicate() and every rank of its shard group holds its value (its reduced gradient, which the
reduce-scatter leaves on shard rank 0, goes to every rank in one small sum, bit for bit:
collectives.share_replicated_scalars).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ...handles import Group


def make_mesh(world: Group, shard_group: Group, replica_group: Group | None, device_type: str,
              shard_device_type: str, torch_process_group: bool) -> Any:
    """The DeviceMesh DTensor parameters live on, or None where parameters stay plain rows."""
    if shard_group.size <= 1 or not torch_process_group or shard_device_type != device_type:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    if replica_group is None or replica_group.size <= 1:
        return DeviceMesh.from_group(shard_group.handle, device_type)
    # HYBRID: shard groups are consecutive blocks of the world, replicas stride across them
    # (sharding/setup/groups.py), so the world's ranks laid out (replicas, shard) are the mesh.
    layout = torch.tensor(world.ranks, dtype=torch.int).view(replica_group.size, shard_group.size)
    if (tuple(layout[replica_group.rank].tolist()) != tuple(shard_group.ranks)
            or tuple(layout[:, shard_group.rank].tolist()) != tuple(replica_group.ranks)):
        return None  # groups laid out otherwise: no mesh describes them; stay plain rows
    return DeviceMesh.from_group([replica_group.handle, shard_group.handle], device_type,
                                 mesh=layout, mesh_dim_names=("replicate", "shard"))


def placements(mesh: Any, ndim: int) -> tuple[Any, ...]:
    """Shard(0) over the shard group (Replicate for a 0-d parameter), Replicate over replicas."""
    from torch.distributed.tensor import Replicate, Shard

    rows = Shard(0) if ndim else Replicate()
    return (Replicate(), rows) if mesh.ndim == 2 else (rows,)


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `shape`."""
    stride, step = [], 1
    for size in reversed(tuple(shape)):
        stride.append(step)
        step *= max(1, int(size))
    return tuple(reversed(stride))


def whole_spec(mesh: Any, places: tuple[Any, ...], full_shape: torch.Size,
               dtype: torch.dtype) -> Any:
    """The DTensorSpec of a whole parameter of `full_shape` and `dtype` on `mesh`."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    return DTensorSpec(mesh, places, TensorMeta(full_shape, contiguous_stride(full_shape), dtype))


def whole(rows: torch.Tensor, spec: Any) -> Any:
    """A DTensor of `spec` whose local tensor is `rows` (this rank's real rows, no copy).

    Built straight from the spec, as FSDP2 builds its own: DTensor.from_local runs checks and an
    autograd function each call (about 230 us against 2 us here), and gradients are wrapped once
    per parameter per step.
    """
    from torch.distributed.tensor import DTensor

    return DTensor(rows, spec, requires_grad=False)


def is_dtensor(tensor: object) -> bool:
    """True for a torch DTensor (without importing torch.distributed.tensor where it is absent)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(tensor, DTensor)


def local_rows_of(param: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor through autograd (its gradient comes back as a DTensor)."""
    return param.to_local()  # type: ignore[attr-defined]


def full_of(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (collective over its mesh)."""
    return tensor.full_tensor()  # type: ignore[attr-defined]


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (no copy, outside autograd); any other tensor itself."""
    if is_dtensor(tensor):
        return tensor._local_tensor  # type: ignore[attr-defined]
    return tensor


# ---- .item() of a partial value -------------------------------------------------------------
# torch answers .item() / float() of a DTensor whose placement is Partial (p.grad.norm(),
# p.sum(): each rank holds its part of a sum still to be taken) with this rank's part, silently
# (its dispatcher skips sharding propagation for that op). Refusing it, with the call that gives
# the whole value, keeps "never a silent per-rank result"; doing the collective instead would hang
# the common `if rank == 0: log(p.grad.norm().item())`.
_item_op: Any = None
_previous_item_handler: Any = None


def _refuse_partial_item(op: Any, args: tuple, kwargs: dict) -> Any:
    tensor = args[0]
    if any(p.is_partial() for p in tensor.placements):
        from ...errors import ShardkitError

        raise ShardkitError(
            "this value was reduced over a sharded tensor (e.g. p.grad.norm() or p.sum() of a "
            "parameter sharded by shardkit): each rank holds only its part of the result, so "
            ".item()/float() would give this rank's part, not the whole model's. HINT: call "
            ".full_tensor() first, on every rank of the group (p.grad.norm().full_tensor()."
            "item()), or shardkit.full_tensor(p, p.grad) for the whole gradient")
    if _previous_item_handler is not None:
        return _previous_item_handler(op, args, kwargs)
    return tensor._local_tensor.item()


def refuse_partial_items() -> None:
    """Make .item()/float() of a Partial DTensor raise, naming .full_tensor() (idempotent)."""
    global _item_op, _previous_item_handler
    if _item_op is not None:
        return
    from torch.distributed.tensor import DTensor

    op = torch.ops.aten._local_scalar_dense.default
    handlers = DTensor._op_dispatcher._custom_op_handlers
    _previous_item_handler = handlers.get(op)
    handlers[op] = _refuse_partial_item  # type: ignore[assignment]
    _item_op = op


def allow_partial_items() -> None:
    """Put torch's own .item() of DTensors back (shutdown(), process_state.reset)."""
    global _item_op, _previous_item_handler
    if _item_op is None:
        return
    from torch.distributed.tensor import DTensor

    handlers = DTensor._op_dispatcher._custom_op_handlers
    if handlers.get(_item_op) is _refuse_partial_item:
        if _previous_item_handler is None:
            del handlers[_item_op]
        else:
            handlers[_item_op] = _previous_item_handler
    _item_op = _previous_item_handler = None
