"""A user-given DeviceMesh for the data-parallel dimensions: `shard(model, mesh=...)`, FSDP2's `mesh=`.

A torchtitan-style job builds one `init_device_mesh` and hands each parallelism its dimensions;
the data-parallel one then runs on the user's process groups and the parameters are DTensors on
the user's mesh (`param.device_mesh is mesh`), as under FSDP2, so a state dict or a DCP
checkpoint names the same mesh either way. The mesh's meaning is FSDP2's: one dimension for
FULL_SHARD / SHARD_GRAD_OP (shard across it) and NO_SHARD (replicate across it), two,
(replicate, shard), for HYBRID_SHARD.

The engine's other groups (reshard_after_forward=k's blocks, the two-hop reduction's node
groups) are cut from runs of consecutive world ranks, and its HYBRID layout is shard groups of
consecutive ranks with replicas striding across them (setup/groups.py). So a mesh over every rank
is taken when it lays the world's ranks out in that order (what `init_device_mesh` makes) and is
refused with what to do otherwise.

A mesh over only some of the ranks is one dimension of a larger mesh. It is taken beside torch's
tensor parallelism: the model's DTensor parameters live on one 1-D TP mesh that meets the
data-parallel mesh at this rank alone, the two holding every rank between them (mesh["dp"] and
mesh["tp"] of one init_device_mesh). The shard groups then stride across the world, so the
k-rank blocks of reshard_after_forward=k are cut from each of them (`all_shard_groups`). Anything
else over part of the ranks (pipeline stages) is refused. Nothing here creates or destroys a
group: the mesh's groups are the user's.
"""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn

from ...backend import Backend
from ...errors import ShardkitError
from ...handles import Group
from ..policies import ShardingStrategy
from ..step.whole_view import is_dtensor
from .groups import solo_group

_ONE_DIM = (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD)


def describe_mesh(mesh: Any) -> str:
    """The mesh as a line every rank must agree on (its shape, dimension names and device type)."""
    if mesh is None:
        return "mesh: none (shardkit's groups)"
    return (f"mesh: shape {tuple(mesh.shape)}, dims {mesh.mesh_dim_names}, "
            f"device type {mesh.device_type}")


def tensor_parallel_meshes(model: nn.Module) -> list[Any]:
    """The distinct meshes of the model's DTensor parameters (torch's tensor parallelism made them)."""
    meshes: list[Any] = []
    for param in model.parameters():
        mesh = getattr(param, "device_mesh", None) if is_dtensor(param) else None
        # (equal meshes are one: torch may hand out a new object for the same mesh["tp"])
        if mesh is not None and all(mesh is not m and mesh != m for m in meshes):
            meshes.append(mesh)
    return meshes


def check_mesh(mesh: Any, strategy: ShardingStrategy, hybrid_group_size: int | None,
               fault_tolerant: bool, world: Group, backend: Backend, device_type: str,
               tp_meshes: Sequence[Any] = ()) -> int | None:
    """Refuse a mesh shard() cannot run on, naming why; return the shard group size it implies
    for HYBRID_SHARD (hybrid_group_size unchanged otherwise). No collective: every rank decides alone.

    `tp_meshes`: the meshes of the model's tensor-parallel parameters; with one, the mesh is the
    other dimension(s) of the same mesh and the two together hold every rank."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise ShardkitError(
            f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}. "
            "HINT: build it with torch.distributed.device_mesh.init_device_mesh(device_type, "
            "(ranks,)) and pass it, or one of its dimensions (mesh['dp']), as FSDP2's mesh=")
    if not backend.capabilities.torch_process_group:
        raise ShardkitError(
            f"backend {backend.name!r} cannot run on a DeviceMesh: its collectives do not run on "
            "torch process groups (Capabilities.torch_process_group is False), and a mesh's "
            "dimensions are torch process groups. HINT: leave mesh= out; shard() makes the "
            "backend's own groups")
    if fault_tolerant:
        raise ShardkitError(
            "mesh= and fault_tolerance= do not go together: under fault tolerance each launched "
            "job is one replica group, sharded across all its ranks, and the replicas are joined "
            "by torchft, not by a mesh dimension. HINT: leave mesh= out")
    want = 1 if strategy in _ONE_DIM else 2
    if mesh.ndim != want:
        shape = "(ranks,)" if want == 1 else "(replica groups, ranks per group)"
        raise ShardkitError(
            f"strategy {strategy.name} takes a {want}-D mesh {shape}, got a {mesh.ndim}-D mesh of "
            f"shape {tuple(mesh.shape)}. HINT: FULL_SHARD, SHARD_GRAD_OP and NO_SHARD take one "
            "dimension (mesh['dp']); HYBRID_SHARD takes two, (replicate, shard) "
            "(mesh['dp_replicate', 'dp_shard']), as FSDP2's fully_shard does")
    # A rehearsal (the planner's) computes on meta whatever device type its fake mesh names.
    if mesh.device_type != device_type and backend.capabilities.holds_values:
        raise ShardkitError(
            f"the mesh is on {mesh.device_type!r} devices but this model computes on "
            f"{device_type!r} (backend {backend.name!r}). HINT: build the mesh with "
            f"init_device_mesh({device_type!r}, ...)")
    _check_library(mesh, backend)
    layout = [int(r) for r in mesh.mesh.flatten().tolist()]
    if tp_meshes:
        _check_tensor_parallel_mesh(mesh, tp_meshes, world)
    elif len(layout) != world.size:
        raise ShardkitError(
            f"the mesh holds {len(layout)} of the job's {world.size} ranks ({layout}) and the "
            "model has no tensor-parallel (DTensor) parameters on the mesh's other dimension: "
            "shard() takes part of the ranks only beside torch's tensor parallelism. HINT: pass a "
            "mesh over every rank (or leave mesh= out); for tensor x data parallelism "
            "parallelize_module(model, mesh['tp'], plan) first, then shard(model, mesh=mesh['dp'])")
    if not tp_meshes and layout != list(world.ranks):
        raise ShardkitError(
            f"the mesh lays the ranks out as {mesh.mesh.tolist()}; shard() needs them in rank "
            f"order, {list(world.ranks)} row by row (the layout init_device_mesh makes: shard "
            "groups of consecutive ranks). HINT: build the mesh with init_device_mesh")
    if want == 1:
        return hybrid_group_size
    size = int(mesh.shape[1])
    if hybrid_group_size not in (None, size):
        raise ShardkitError(
            f"hybrid_group_size={hybrid_group_size} disagrees with the mesh, whose shard "
            f"dimension has {size} ranks (shape {tuple(mesh.shape)}). HINT: leave "
            "hybrid_group_size out: the mesh says it")
    return size


def _check_tensor_parallel_mesh(mesh: Any, tp_meshes: Sequence[Any], world: Group) -> None:
    if len(tp_meshes) > 1:
        raise ShardkitError(
            f"the model's DTensor parameters live on {len(tp_meshes)} different meshes; shard() "
            "composes with one tensor-parallel mesh. HINT: parallelize_module the whole model "
            "on one mesh['tp']")
    tp = tp_meshes[0]
    if tp.ndim != 1:
        raise ShardkitError(
            f"the model's tensor-parallel mesh has {tp.ndim} dimensions; shard() composes with "
            "one. HINT: parallelize_module on a 1-D mesh['tp']")
    if tp.device_type != mesh.device_type:
        raise ShardkitError(
            f"the tensor-parallel mesh is on {tp.device_type!r} devices, the data-parallel mesh "
            f"on {mesh.device_type!r}. HINT: take both from one init_device_mesh")
    ranks = {int(r) for r in mesh.mesh.flatten().tolist()}
    tp_ranks = {int(r) for r in tp.mesh.flatten().tolist()}
    if ranks & tp_ranks != {world.ranks[world.rank]} or len(ranks) * len(tp_ranks) != world.size:
        raise ShardkitError(
            f"the data-parallel mesh {mesh.mesh.tolist()} and the model's tensor-parallel mesh "
            f"{tp.mesh.tolist()} are not two dimensions of one mesh over the job's {world.size} "
            "ranks (they must meet at this rank alone and hold every rank between them). HINT: "
            "mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')); "
            "parallelize_module(model, mesh['tp'], plan); shard(model, mesh=mesh['dp'])")


def all_shard_groups(mesh: Any, tp_meshes: Sequence[Any]) -> list[list[int]] | None:
    """Every shard group of the job, as global ranks in group order, where a tensor-parallel
    mesh beside the data-parallel one makes them stride across the world (None: runs of
    consecutive ranks, setup/groups.py's layout). Read from the two meshes concatenated."""
    if not tp_meshes:
        return None
    from torch.distributed.device_mesh import DeviceMesh

    layout = DeviceMesh._concatenate([mesh, tp_meshes[0]]).mesh  # (dp dims..., tp)
    shard_dim = mesh.ndim - 1  # the last data-parallel dimension shards (HYBRID: (replicate, shard))
    groups = layout.movedim(shard_dim, -1).reshape(-1, layout.shape[shard_dim])
    return [[int(r) for r in row] for row in groups.tolist()]


def check_tensor_parallel_options(strategy: ShardingStrategy, sync: bool, meta: bool,
                                  cpu_offload: bool, quantized: bool) -> None:
    """Refuse, naming the setting, what shard() does not yet do on a tensor-parallel model."""
    refused = [name for name, on in (
        ("sync_module_states=True", sync),
        ("a model on the meta device", meta),
        ("cpu_offload=True", cpu_offload),
        ("quantize=", quantized)) if on]
    if refused:
        raise ShardkitError(
            f"{', '.join(refused)} with a tensor-parallel model (DTensor parameters from "
            "parallelize_module) is not supported yet. HINT: leave it out; exact collectives and "
            f"a model built on its device and parallelized there work ({strategy.name})")


def _check_library(mesh: Any, backend: Backend) -> None:
    import torch.distributed as dist

    wanted = backend.collectives.process_group_backend().lower()
    for dim in range(mesh.ndim):
        library = str(dist.get_backend(mesh.get_group(dim))).lower()
        if wanted not in library:
            raise ShardkitError(
                f"the mesh's dimension {dim} runs on {library!r} process groups, but backend "
                f"{backend.name!r} runs its collectives on {wanted!r}. HINT: build the mesh after "
                f"shardkit.init() (its groups then use {wanted!r}), or pick the backend whose "
                "library the mesh uses")


def groups_from_mesh(mesh: Any, strategy: ShardingStrategy, world: Group) -> tuple[Group, Group | None]:
    """(shard_group, replica_group) of this rank on a mesh check_mesh accepted: its own groups."""
    if strategy is ShardingStrategy.NO_SHARD:
        return solo_group(world.ranks[world.rank]), _dim_group(mesh, 0)
    if mesh.ndim == 1:
        return _dim_group(mesh, 0), None
    return _dim_group(mesh, 1), _dim_group(mesh, 0)


def _dim_group(mesh: Any, dim: int) -> Group:
    import torch.distributed as dist

    if mesh.shape[dim] == 1:
        return solo_group(mesh.get_rank())
    handle = mesh.get_group(dim)
    ranks = tuple(dist.get_process_group_ranks(handle))
    group = Group(mesh.get_local_rank(dim), len(ranks), ranks, handle)
    # Collectives place slice i at the group's i-th rank, DTensor at mesh coordinate i: they
    # must be the same rank (check_mesh's rank-order layout makes them so).
    assert ranks[group.rank] == mesh.get_rank(), (ranks, group.rank, mesh.get_rank())
    return group
