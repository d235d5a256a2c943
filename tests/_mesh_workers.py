"""Per-rank workers for shard(model, mesh=...): a user's DeviceMesh for the data-parallel dimensions."""

from __future__ import annotations

import copy
import dataclasses
import gc
import types
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import shardkit
from shardkit.sharding.policies import ShardingStrategy
from shardkit.sharding.setup.mesh import check_mesh

from _models import Block, TinyNet, batch
from _sharding_workers import full_params, parity_run

STEPS = 5
WRAP = shardkit.wrap.transformer_layers({Block})


def _user_mesh(strategy: str, world: int) -> DeviceMesh:
    if strategy == "HYBRID_SHARD":
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))


def _train(model: torch.nn.Module, rank: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, rank)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _fsdp2(strategy: str, mesh: DeviceMesh, model: torch.nn.Module) -> torch.nn.Module:
    """torch's own engine on the same mesh: fully_shard (HSDP on a 2-D mesh), DDP for NO_SHARD."""
    if strategy == "NO_SHARD":
        return torch.nn.parallel.DistributedDataParallel(model, process_group=mesh.get_group(0))
    from torch.distributed.fsdp import fully_shard

    keep = strategy == "SHARD_GRAD_OP"
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=not keep)
    fully_shard(model, mesh=mesh, reshard_after_forward=not keep)
    return model


def _whole(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return {k: v.detach().clone() for k, v in model.module.named_parameters()}
    return {k: v.full_tensor().detach().clone() for k, v in model.named_parameters()}


def on_a_mesh(rank: int, world: int, strategy: str, extra: dict) -> dict:
    """shard(mesh=) beside shard() without one, torch's engine on the same mesh, and the
    unsharded model: weights, the mesh the parameters live on, groups made, lifetime."""
    mesh = _user_mesh(strategy, world)
    torch.manual_seed(0)
    base = TinyNet()
    groups_before = len(dist.distributed_c10d._world.pg_map)
    ours = shardkit.shard(copy.deepcopy(base), strategy=strategy, auto_wrap_policy=WRAP,
                          mesh=mesh, **extra)
    out: dict = {"groups_made": len(dist.distributed_c10d._world.pg_map) - groups_before}
    out["on_the_mesh"] = all(p.device_mesh is mesh for p in ours.parameters())
    out["placements"] = sorted({str(tuple(p.placements)) for p in ours.parameters()})
    out["losses"] = _train(ours, rank)
    mine = full_params(ours)
    plain = shardkit.shard(copy.deepcopy(base), strategy=strategy, auto_wrap_policy=WRAP,
                           **({"hybrid_group_size": world // 2} if strategy == "HYBRID_SHARD"
                              else {}), **extra)
    out["plain_losses"] = _train(plain, rank)
    theirs = _fsdp2(strategy, mesh, copy.deepcopy(base))
    out["torch_losses"] = _train(theirs, rank)
    out["vs_plain"] = max((mine[k] - v).abs().max().item() for k, v in full_params(plain).items())
    out["vs_torch"] = max((mine[k] - v).abs().max().item() for k, v in _whole(theirs).items())
    if strategy != "NO_SHARD":  # torch's state dict of ours loads into torch's engine on the mesh
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        fresh = _fsdp2(strategy, mesh, TinyNet())
        set_model_state_dict(fresh, get_model_state_dict(ours))
        out["into_torch"] = max((mine[k] - v).abs().max().item() for k, v in _whole(fresh).items())
    dead = weakref.ref(ours)
    del ours, plain, theirs
    gc.collect()
    out["freed"] = dead() is None
    out["mesh_groups_alive"] = all(
        dist.get_process_group_ranks(mesh.get_group(d)) for d in range(mesh.ndim))
    out["diffs"] = parity_run(rank, strategy, world, dict(extra, mesh=mesh))["diffs"]
    return out


def refusals(rank: int, world: int) -> dict:
    """What each misuse of mesh= says (2 ranks)."""
    said: dict = {}

    def attempt(name: str, **kwargs) -> None:
        try:
            shardkit.shard(TinyNet(), **kwargs)
            said[name] = None
        except shardkit.ShardkitError as exc:
            said[name] = str(exc)

    grid = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))
    flat = init_device_mesh("cpu", (world,))
    attempt("not_a_mesh", mesh="dp")
    attempt("two_dims_full_shard", mesh=grid)
    attempt("one_dim_hybrid", strategy="HYBRID_SHARD", mesh=flat)
    attempt("hybrid_size", strategy="HYBRID_SHARD", mesh=grid, hybrid_group_size=2)
    attempt("sub_mesh", mesh=grid["tp"])
    attempt("out_of_order", mesh=DeviceMesh("cpu", list(reversed(range(world)))))
    attempt("fault_tolerant", strategy="HYBRID_SHARD", mesh=grid,
            fault_tolerance=shardkit.FaultTolerance(replica_group=0, lighthouse="http://127.0.0.1:1"))
    be = shardkit.current_context().backend
    threads = types.SimpleNamespace(name="threads", capabilities=dataclasses.replace(
        be.capabilities, torch_process_group=False))
    try:
        check_mesh(flat, ShardingStrategy.FULL_SHARD, None, False,
                   shardkit.current_context().world, threads, "cpu")  # type: ignore[arg-type]
        said["no_process_groups"] = None
    except shardkit.ShardkitError as exc:
        said["no_process_groups"] = str(exc)
    attempt("accepted", mesh=grid["dp"])
    return said
