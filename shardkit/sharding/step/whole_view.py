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

One parameter form wherever a DeviceMesh can exist (`choose_form`, at shard(): a backend whose
collectives run on torch.distributed process groups: cpu, cuda, xpu, composed pairs): every
strategy, a world of one and cpu_offload included. A shard group of one rank (NO_SHARD, a world of
one) holds whole parameters: Replicate() over the world. With cpu_offload on an accelerator the
local rows live on the host and the mesh on the compute device's type, as FSDP2 lays them out.
The one other form is `RowParams`, for a backend without torch process groups (XLA's device
threads): no mesh can exist, the parameters are the plain padded rows, torch's clip_grad_norm_ is
covered by sharding/surface/torch_norms.py and the other idioms need shardkit.full_shape /
full_tensor. ShardedParam holds its form and asks it; no step-path code asks which one it is.

Beside torch's tensor parallelism (a user's mesh: setup/mesh.py) every parameter lives on the
data-parallel mesh and TP's concatenated, as FSDP2's 2-D parameters do: TP's placements follow the
data-parallel ones, a parameter TP did not split is Replicate() over TP, and where TP splits dim 0
the data-parallel rows are rows of TP's part (`_StridedShard`, tp_whole_spec).

HYBRID_SHARD's mesh has two dimensions, (replicas, shard group): rows are Shard(0) inside a shard
group and Replicate() across replicas. A 0-d parameter cannot be split by rows: it is
Replicate() and every rank of its shard group holds its value (its reduced gradient, which the
reduce-scatter leaves on shard rank 0, goes to every rank in one small sum, bit for bit:
collectives.share_replicated_scalars).
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import torch

from ...handles import Group


class WholeParams:
    """The parameter form wherever a DeviceMesh exists: a DTensor of the whole parameter over
    this rank's real rows (Shard(0) over the shard group, Replicate over replicas)."""

    def __init__(self, mesh: Any, shard_group_size: int, tp_mesh: Any = None) -> None:
        self.mesh = mesh
        self.shard_group_size = shard_group_size
        # Beside tensor parallelism every parameter lives on the data-parallel mesh and TP's,
        # concatenated (one mesh: torch's foreach ops and clip_grad_norm_ take no mix of meshes);
        # one TP did not split is Replicate() over TP.
        self.spmd_mesh = None
        if tp_mesh is not None:
            from torch.distributed.device_mesh import DeviceMesh

            self.spmd_mesh = DeviceMesh._concatenate([mesh, tp_mesh])

    def alignment(self, backend_alignment: int) -> int:
        """A DTensor's Shard(0) is torch.chunk's split: no alignment may widen the rows."""
        return 1

    def placements(self, ndim: int) -> tuple[Any, ...]:
        """Shard(0) over the shard group (Replicate for a 0-d parameter or a group of one
        rank), Replicate over replicas."""
        return placements(self.mesh, ndim, self.shard_group_size)

    def replicates_scalars(self) -> bool:
        """A 0-d parameter is Replicate(): every rank of its shard group holds its value."""
        return True

    def spec(self, places: tuple[Any, ...], full_shape: torch.Size, dtype: torch.dtype) -> Any:
        """The DTensorSpec of a whole parameter of `full_shape` and `dtype` on this mesh (and
        Replicate() over tensor parallelism's, beside it)."""
        if self.spmd_mesh is not None:
            from torch.distributed.tensor import Replicate

            return whole_spec(self.spmd_mesh, places + (Replicate(),), full_shape, dtype)
        return whole_spec(self.mesh, places, full_shape, dtype)

    def tp_spec(self, places: tuple[Any, ...], tp: Any, dtype: torch.dtype) -> Any:
        """The DTensorSpec of a tensor-parallel parameter (TP's spec `tp`) sharded by rows here
        too: on this mesh and TP's, concatenated."""
        assert self.spmd_mesh is not None, "shard() names the TP mesh (setup/mesh.py)"
        return tp_whole_spec(self.spmd_mesh, places, tp, dtype)

    def user_rows(self, rows: torch.Tensor, valid_rows: int, ndim: int) -> torch.Tensor:
        """The part of shard-shaped `rows` the user's tensor covers: its real rows."""
        return rows[:valid_rows] if ndim else rows

    def as_user(self, rows: torch.Tensor, spec: Any) -> torch.Tensor:
        """The DTensor of `spec` over `rows` (the real rows, no copy)."""
        return whole(rows, spec)

    def autograd_rows(self, param: torch.Tensor) -> torch.Tensor:
        """The parameter's rows through autograd (the gradient comes back as a DTensor)."""
        return local_rows_of(param)

    def hand_over(self) -> None:
        """Process-wide idioms this form needs: p.grad.norm().item() of a part is refused."""
        refuse_partial_items()

    def release_with(self, owner: object) -> None:
        """Once `owner` (the model's engine state) dies, have torch's op caches forget the mesh."""
        weakref.finalize(owner, note_mesh_released).atexit = False


class RowParams:
    """The parameter form where no DeviceMesh can exist (a backend whose collectives run on
    no torch process group: XLA's device threads): the plain padded rows themselves."""

    mesh = None

    def alignment(self, backend_alignment: int) -> int:
        """The backend's own row alignment applies (nothing else reads the layout)."""
        return backend_alignment

    def placements(self, ndim: int) -> tuple[Any, ...]:
        """No placements: there is no DTensor."""
        return ()

    def replicates_scalars(self) -> bool:
        """A 0-d parameter lives on shard rank 0 alone, like every row."""
        return False

    def spec(self, places: tuple[Any, ...], full_shape: torch.Size, dtype: torch.dtype) -> Any:
        """No spec: there is no DTensor."""
        return None

    def tp_spec(self, places: tuple[Any, ...], tp: Any, dtype: torch.dtype) -> Any:
        """Never asked: shard() refuses a mesh (and so tensor parallelism) on such a backend."""
        raise AssertionError("tensor-parallel parameters need a DeviceMesh (setup/mesh.py)")

    def user_rows(self, rows: torch.Tensor, valid_rows: int, ndim: int) -> torch.Tensor:
        """The whole padded rows: the user's tensor is the shard itself."""
        return rows

    def as_user(self, rows: torch.Tensor, spec: Any) -> torch.Tensor:
        """The rows themselves."""
        return rows

    def autograd_rows(self, param: torch.Tensor) -> torch.Tensor:
        """The parameter itself: it is already the rows."""
        return param

    def hand_over(self) -> None:
        """Nothing process-wide: torch_norms covers clip_grad_norm_ for plain rows."""

    def release_with(self, owner: object) -> None:
        """Nothing to release: no mesh."""


ParamForm = WholeParams | RowParams


def choose_form(world: Group, shard_group: Group, replica_group: Group | None, device_type: str,
                torch_process_group: bool, user_mesh: Any = None, tp_mesh: Any = None) -> ParamForm:
    """The one place the parameter form is decided (at shard()): DTensor parameters on a
    DeviceMesh wherever the backend's collectives run on torch process groups (the user's mesh
    where one was given, beside TP's `tp_mesh`), else plain rows."""
    if user_mesh is not None:  # (setup/mesh.py refused it on a backend without process groups)
        return WholeParams(user_mesh, shard_group.size, tp_mesh)
    if not torch_process_group:
        return RowParams()
    return WholeParams(make_mesh(world, shard_group, replica_group, device_type),
                       shard_group.size)


def make_mesh(world: Group, shard_group: Group, replica_group: Group | None,
              device_type: str) -> Any:
    """The DeviceMesh DTensor parameters live on (groups on torch process groups)."""
    from torch.distributed.device_mesh import DeviceMesh

    if shard_group.size <= 1:
        # Every rank holds whole parameters (NO_SHARD, a world of one): Replicate() over the world.
        return DeviceMesh.from_group(world.handle, device_type)
    if replica_group is None or replica_group.size <= 1:
        return DeviceMesh.from_group(shard_group.handle, device_type)
    # HYBRID: shard groups are consecutive blocks of the world, replicas stride across them
    # (sharding/setup/groups.py), so the world's ranks laid out (replicas, shard) are the mesh.
    layout = torch.tensor(world.ranks, dtype=torch.int).view(replica_group.size, shard_group.size)
    if (tuple(layout[replica_group.rank].tolist()) != tuple(shard_group.ranks)
            or tuple(layout[:, shard_group.rank].tolist()) != tuple(replica_group.ranks)):
        raise AssertionError(f"shard groups {shard_group.ranks} and replica groups "
                             f"{replica_group.ranks} are not the blocks and strides groups.py makes")
    return DeviceMesh.from_group([replica_group.handle, shard_group.handle], device_type,
                                 mesh=layout, mesh_dim_names=("replicate", "shard"))


# torch's DTensor remembers the sharding of every op it has run (a Python lru_cache and its C++
# fast path's cache), unbounded and keyed by specs that hold their DeviceMesh, so a dead model's
# mesh (and its rank table) would stay for the life of the process. Clearing those caches from
# the model's finalizer could pull an entry from under a dispatch that the collection
# interrupted; the finalizer only counts the mesh, and the next shard() or shutdown() clears.
_released_meshes = 0


def note_mesh_released() -> None:
    """Count a dead model's mesh, for forget_released_meshes (safe inside a finalizer)."""
    global _released_meshes
    _released_meshes += 1


def forget_released_meshes() -> None:
    """Drop torch's cached op shardings when a model's mesh has died since the last call."""
    global _released_meshes
    if not _released_meshes:
        return
    _released_meshes = 0
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return
    propagator = DTensor._op_dispatcher.sharding_propagator
    for cache in (propagator.propagate_op_sharding,
                  getattr(propagator, "_propagate_tensor_meta_cached", None)):
        if cache is not None and hasattr(cache, "cache_clear"):
            cache.cache_clear()
    clear_fast_path = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_fast_path is not None:  # newer torch keeps a C++ copy of the same cache
        clear_fast_path()


def placements(mesh: Any, ndim: int, shard_group_size: int) -> tuple[Any, ...]:
    """Shard(0) over the shard group (Replicate for a 0-d parameter, or a group of one rank),
    Replicate over replicas."""
    from torch.distributed.tensor import Replicate, Shard

    rows = Shard(0) if ndim and shard_group_size > 1 else Replicate()
    return (Replicate(), rows) if mesh.ndim == 2 else (rows,)


def tp_whole_spec(mesh: Any, places: tuple[Any, ...], tp: Any, dtype: torch.dtype) -> Any:
    """The DTensorSpec of a tensor-parallel parameter sharded by rows over the data-parallel
    dimensions too: the data-parallel placements, then TP's, on `mesh` (the two concatenated).

    Where TP already splits dim 0 (ColwiseParallel), the data-parallel rows are rows of TP's
    part, not of the whole: torch's _StridedShard says so (FSDP2 lays 2-D parameters out alike).
    """
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    split = tp.num_shards_map[0]
    rows = tuple(_StridedShard(0, split_factor=split) if split > 1 and isinstance(p, Shard)
                 and p.dim == 0 else p for p in places)
    shape = tp.tensor_meta.shape
    return whole_spec(mesh, rows + tuple(tp.placements), shape, dtype)


def with_dtype(spec: Any, dtype: torch.dtype) -> Any:
    """`spec` for a tensor of `dtype` (the same mesh, placements and shape)."""
    if spec.tensor_meta.dtype == dtype:
        return spec
    return whole_spec(spec.mesh, tuple(spec.placements), spec.tensor_meta.shape, dtype)


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
