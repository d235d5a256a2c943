"""A user-given DeviceMesh for the data-parallel dimensions: `shard(model, mesh=...)`, FSDP2's `mesh=`.

A torchtitan-style job builds one `init_device_mesh` and hands each parallelism its dimensions;
the data-parallel one then runs on the user's process groups and the parameters are DTensors on
the user's mesh (`param.device_mesh is mesh`), as under FSDP2, so a state dict or a DCP
checkpoint names the same mesh either way. The mesh's meaning is FSDP2's: one dimension for
FULL_SHARD / SHARD_GRAD_OP (shard across it) and NO_SHARD (replicate across it), two,
(replicate, shard), for HYBRID_SHARD.

The engine's other groups (reshard_after_forward=k's blocks, the two-hop reduction's node
groups) are cut from runs of consecutive world ranks, and its HYBRID layout is shard groups of
consecutive ranks with replicas striding across them (setup/groups.py). So a mesh is taken when
it lays the world's ranks out in that order (what `init_device_mesh` makes) and is refused with
what to do otherwise, as is a mesh over only some of the ranks (one dimension of a larger mesh,
beside tensor or pipeline parallelism), which this engine does not compose with yet. Nothing here
creates or destroys a group: the mesh's groups are the user's.
"""

from __future__ import annotations

from typing import Any

from ...backend import Backend
from ...errors import ShardkitError
from ...handles import Group
from ..policies import ShardingStrategy
from .groups import solo_group

_ONE_DIM = (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD)


def describe_mesh(mesh: Any) -> str:
    """The mesh as a line every rank must agree on (its shape, dimension names and device type)."""
    if mesh is None:
        return "mesh: none (shardkit's groups)"
    return (f"mesh: shape {tuple(mesh.shape)}, dims {mesh.mesh_dim_names}, "
            f"device type {mesh.device_type}")


def check_mesh(mesh: Any, strategy: ShardingStrategy, hybrid_group_size: int | None,
               fault_tolerant: bool, world: Group, backend: Backend, device_type: str) -> int | None:
    """Refuse a mesh shard() cannot run on, naming why; return the shard group size it implies
    for HYBRID_SHARD (hybrid_group_size unchanged otherwise). No collective: every rank decides alone."""
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
    if mesh.device_type != device_type:
        raise ShardkitError(
            f"the mesh is on {mesh.device_type!r} devices but this model computes on "
            f"{device_type!r} (backend {backend.name!r}). HINT: build the mesh with "
            f"init_device_mesh({device_type!r}, ...)")
    _check_library(mesh, backend)
    layout = [int(r) for r in mesh.mesh.flatten().tolist()]
    if len(layout) != world.size:
        raise ShardkitError(
            f"the mesh holds {len(layout)} of the job's {world.size} ranks ({layout}): a "
            "dimension of a larger mesh, beside tensor or pipeline parallelism on the other "
            "dimensions. shardkit.shard() does not compose with those yet. HINT: pass a mesh over "
            "every rank (or leave mesh= out); for tensor x data parallelism today use FSDP2's "
            "fully_shard(model, mesh=mesh['dp'])")
    if layout != list(world.ranks):
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


def _check_library(mesh: Any, backend: Backend) -> None:
    import torch.distributed as dist

    wanted = backend.process_group_backend().lower()
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
