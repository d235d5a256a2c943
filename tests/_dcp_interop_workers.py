"""Per-rank workers: torch DCP checkpoints written by FSDP2 (its users' layout and torchtitan's)
read by shardkit.checkpoint.load, and shardkit's checkpoints read by FSDP2 through torch's own
dcp.load, at the world size that wrote them and another.

Every run trains TinyNet on the same global batch of 12 per step, split evenly over the ranks, so
the global loss (the mean of the ranks' equal shares) is comparable across world sizes.
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict)

import shardkit

from _models import TinyNet, batch

GLOBAL = 12


def _step(model, opt, step: int, rank: int, world: int) -> float:
    x, y = batch(step, 0, GLOBAL)
    rows = slice(rank * GLOBAL // world, (rank + 1) * GLOBAL // world)
    loss = F.cross_entropy(model(x[rows]), y[rows])
    loss.backward()
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    torch.distributed.all_reduce(total)
    return total.item() / world


def _optimizer(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def fsdp2_save_and_resume(rank: int, world: int, directory: str, layout: str) -> dict:
    """FSDP2 trains 2 steps, saves a DCP checkpoint in `layout`, and trains 2 more (its own resume)."""
    torch.manual_seed(0)
    model = _fsdp2_model(world)
    opt = _optimizer(model)
    for step in range(2):
        _step(model, opt, step, rank, world)
    if layout == "fsdp2":  # what FSDP2's tutorial saves
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    else:  # torchtitan: the model's entries at the top level, the optimizer flattened
        state = {**get_model_state_dict(model),
                 "optimizer": get_optimizer_state_dict(
                     model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True)),
                 "train_state": {"step": 2}}
    dcp.save(state, checkpoint_id=directory)
    losses = [_step(model, opt, step, rank, world) for step in range(2, 4)]
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
            for k, v in get_model_state_dict(model).items()}
    return {"losses": losses, "weights": full}


def shardkit_resume(rank: int, world: int, directory: str, with_optimizer: bool) -> dict:
    """shardkit.checkpoint.load of the DCP folder, then the same 2 steps."""
    torch.manual_seed(1)  # other initial weights: the load must replace all of them
    model = shardkit.shard(TinyNet(), auto_wrap_policy=shardkit.wrap.transformer_layers(
        (type(TinyNet().blocks[0]),)))
    opt = _optimizer(model)
    extra = shardkit.checkpoint.load(directory, model, opt if with_optimizer else None)
    steps_loaded = [float(st["step"]) for st in opt.state.values()] if with_optimizer else []
    losses = [_step(model, opt, step, rank, world) for step in range(2, 4)]
    from shardkit.checkpoint import full_state_dict

    full = full_state_dict(model, rank0_only=False)
    return {"losses": losses, "weights": full, "extra": extra, "steps_loaded": steps_loaded}


def mismatch_run(rank: int, world: int, directory: str) -> str:
    """Loading a DCP folder that holds another model's entries: the error says what to do."""
    from torch import nn

    model = shardkit.shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    try:
        shardkit.checkpoint.load(directory, model)
    except shardkit.checkpoint.StateDictMismatchError as exc:
        return str(exc)
    return "loaded"


def _fsdp2_model(world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = TinyNet()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def shardkit_save_and_resume(rank: int, world: int, directory: str, background: bool) -> dict:
    """shardkit trains 2 steps, saves with shardkit.checkpoint.save, and trains 2 more (its own resume)."""
    from shardkit.checkpoint import full_state_dict

    torch.manual_seed(0)
    model = shardkit.shard(TinyNet(), auto_wrap_policy=shardkit.wrap.transformer_layers(
        (type(TinyNet().blocks[0]),)))
    opt = _optimizer(model)
    for step in range(2):
        _step(model, opt, step, rank, world)
    saved = shardkit.checkpoint.save(directory, model, opt, extra={"step": 2},
                                     background=background)
    if background:
        saved.wait()
    losses = [_step(model, opt, step, rank, world) for step in range(2, 4)]
    return {"losses": losses, "weights": full_state_dict(model, rank0_only=False)}


def fsdp2_load_and_resume(rank: int, world: int, directory: str, with_optimizer: bool) -> dict:
    """FSDP2 reads a shardkit checkpoint with torch's own dcp.load (torchtitan's layout: the
    model's entries at the top level, the optimizer flattened under "optimizer"), then trains 2 steps."""
    from torch.distributed.checkpoint.state_dict import (set_model_state_dict,
                                                         set_optimizer_state_dict)

    torch.manual_seed(1)  # other initial weights: the load must replace all of them
    model = _fsdp2_model(world)
    opt = _optimizer(model)
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    model_sd = get_model_state_dict(model)
    state = {**model_sd}
    if with_optimizer:
        state["optimizer"] = get_optimizer_state_dict(model, opt, options=flat)
    dcp.load(state, checkpoint_id=directory)
    set_model_state_dict(model, {k: state[k] for k in model_sd})
    steps_loaded = []
    if with_optimizer:
        set_optimizer_state_dict(model, opt, state["optimizer"], options=flat)
        steps_loaded = [float(st["step"]) for st in opt.state.values()]
    losses = [_step(model, opt, step, rank, world) for step in range(2, 4)]
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
            for k, v in get_model_state_dict(model).items()}
    return {"losses": losses, "weights": full, "steps_loaded": steps_loaded,
            "lr": [g["lr"] for g in opt.param_groups]}
