"""Rank functions for tests/test_lifetimes.py: every way a model meets shardkit, then `del model`.

Each probe builds a TinyNet, takes it down one path (shard with a strategy, compile, checkpoint,
...), trains a step, and hands back the objects shardkit made for it. The runner keeps only weak
references, drops the model and everything the probe returned, runs gc.collect() once, and
reports what is still alive, and how many process groups torch still knows of.
"""

from __future__ import annotations

import gc
import os
import resource
import time
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardkit
from shardkit.sharding import get_state
from shardkit.wrap import checkpoint_layers, compile_layers

from _models import Block, TinyNet, batch

BLOCKS = shardkit.wrap.transformer_layers(Block)


def live_groups() -> int:
    """Process groups torch.distributed holds in this process (the world group included)."""
    if not dist.is_initialized():
        return 0
    return len(dist.distributed_c10d._world.pg_map)


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage the garbage collector can see."""
    seen, total = set(), 0
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads __class__, which a few deprecated torch
        # objects answer with a warning.
        if issubclass(type(obj), torch.Tensor) and not obj.is_meta:
            try:
                storage = obj.untyped_storage()
                pointer = storage.data_ptr()
            except (RuntimeError, NotImplementedError):  # sparse or wrapper tensors (a DTensor:
                continue  # its local tensor is a gc object of its own and counted there)
            if pointer not in seen:
                seen.add(pointer)
                total += storage.nbytes()
    return total


def collect(refs: list[weakref.ref]) -> None:
    """gc.collect() until every reference is dead, or 40 tries: a collection another thread of the
    rank (the watchdog's, a checkpoint writer's) has in progress makes gc.collect() return at once
    without collecting. A real leak stays alive through every try."""
    for _ in range(40):
        gc.collect()
        if all(ref() is None for ref in refs):
            return
        time.sleep(0.05)


def _step(model: torch.nn.Module, rank: int, optimizer=None) -> torch.Tensor:
    x, y = batch(0, rank)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad()
    return loss


def _sharded(rank: int, **kwargs: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    model = shardkit.shard(TinyNet(), auto_wrap_policy=BLOCKS, **kwargs)
    _step(model, rank, torch.optim.AdamW(model.parameters(), lr=1e-3))
    return model


def _engine_objects(model: torch.nn.Module, shards: bool = True) -> list:
    """What shardkit made for `model`: its state, units and their groups, per-parameter objects
    and (unless shards=False) the shard tensors."""
    state = get_state(model)
    out = [state, *state.units, *state.iter_params()]
    if shards:
        out += [sp.sharded for sp in state.iter_params()]
    out += [g.handle for g in (state.shard_group, state.replica_group) if g is not None
            and g.handle is not None and g.handle is not dist.GroupMember.WORLD]
    out += [u.reshard_group.handle for u in state.units
            if u.reshard_group is not None and u.reshard_group.handle is not None]
    return out


def probe_strategy(rank: int, world: int, strategy: str) -> tuple:
    extra = {"hybrid_group_size": max(1, world // 2)} if strategy == "HYBRID_SHARD" else {}
    model = _sharded(rank, strategy=strategy, **extra)
    return model, _engine_objects(model)


def probe_int_reshard(rank: int, world: int) -> tuple:
    model = _sharded(rank, reshard_after_forward=2)
    return model, _engine_objects(model)


def probe_verify(rank: int, world: int) -> tuple:
    model = _sharded(rank, verify=True)
    return model, _engine_objects(model)


def probe_unshard_and_no_sync(rank: int, world: int) -> tuple:
    model = _sharded(rank)
    with model.no_sync():
        _step(model, rank)
    with model.unshard():
        model(batch(1, rank)[0])
    return model, _engine_objects(model)


def probe_replicate(rank: int, world: int) -> tuple:
    torch.manual_seed(0)
    ddp = shardkit.replicate(TinyNet())
    _step(ddp, rank, torch.optim.AdamW(ddp.parameters(), lr=1e-3))
    return ddp, [ddp.module, *ddp.parameters()]


def probe_block_compile(rank: int, world: int) -> tuple:
    torch.manual_seed(0)
    model = shardkit.shard(TinyNet(), auto_wrap_policy=BLOCKS)
    for block in model.blocks:
        block.compile(backend="eager")
    _step(model, rank)
    _step(model, rank)
    return model, _engine_objects(model)


def probe_compile_layers(rank: int, world: int) -> tuple:
    torch.manual_seed(0)
    model = shardkit.shard(TinyNet(), auto_wrap_policy=BLOCKS)
    compile_layers(model, Block, backend="eager")
    _step(model, rank)
    return model, _engine_objects(model)


def probe_compile_model(rank: int, world: int, fullgraph: bool) -> tuple:
    torch.manual_seed(0)
    model = shardkit.shard(TinyNet(), auto_wrap_policy=BLOCKS)
    compiled = torch.compile(model, backend="eager", fullgraph=fullgraph)
    _step(compiled, rank)
    _step(compiled, rank)
    return compiled, [model, *_engine_objects(model)]


def probe_last_loss_kept(rank: int, world: int, compiled: bool) -> tuple:
    """The user keeps the last step's loss (a notebook variable, a logged value): its autograd
    graph outlives the backward, and must not keep the model."""
    torch.manual_seed(0)
    model = shardkit.shard(TinyNet(), auto_wrap_policy=BLOCKS)
    run = torch.compile(model, backend="eager") if compiled else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(run, rank, optimizer)
    loss = _step(run, rank, optimizer)
    # Compiled, the graph takes the shards themselves as inputs, and torch's AccumulateGrad nodes
    # of a kept graph hold the leaf tensors they feed, with shardkit or without (an unsharded
    # model's parameters stay alive the same way); everything else must go.
    return run, [model, optimizer, *_engine_objects(model, shards=not compiled)], loss


def probe_checkpointing(rank: int, world: int) -> tuple:
    torch.manual_seed(0)
    model = shardkit.shard(TinyNet(), auto_wrap_policy=BLOCKS)
    checkpoint_layers(model, Block)
    _step(model, rank, torch.optim.AdamW(model.parameters(), lr=1e-3))
    return model, _engine_objects(model)


def probe_meta_init(rank: int, world: int) -> tuple:
    with torch.device("meta"):
        model = TinyNet()
    shardkit.shard(model, auto_wrap_policy=BLOCKS)
    _step(model, rank)
    return model, _engine_objects(model)


def probe_checkpoint(rank: int, world: int, directory: str, background: bool) -> tuple:
    model = _sharded(rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, rank, optimizer)
    path = os.path.join(directory, f"bg{int(background)}")
    handle = shardkit.checkpoint.save(path, model, optimizer, step=1, background=background)
    if background:
        handle.wait()
    shardkit.checkpoint.load(path, model, optimizer)
    full = shardkit.checkpoint.full_state_dict(model)
    return model, [optimizer, *_engine_objects(model), *full.values()]


def _destroyed_group(obj: object) -> bool:
    """A process group torch has shut down and forgotten. torch's DTensor dispatch keeps the
    DeviceMeshes it has seen in its sharding caches (FSDP2's as well), and with them the Python
    shells of their groups; destroyed, those hold no sockets, threads or communicators. The
    group count (groups_after) checks the destroy itself."""
    return isinstance(obj, dist.ProcessGroup) and obj not in dist.distributed_c10d._world.pg_map


def run_probe(probe: Callable[..., tuple], *args: Any) -> dict:
    """Run `probe`, drop the model and what it made (the user still holds what it returns third,
    if anything), collect; report the survivors and group counts."""
    groups_before = live_groups()
    model, made, *kept = probe(*args)  # kept: what the user still holds while we look
    groups_with_model = live_groups()
    refs = [weakref.ref(model)] + [weakref.ref(o) for o in made]
    names = [type(model).__name__] + [type(o).__name__ for o in made]
    del model, made
    collect(refs)
    return {"alive": sorted({n for n, r in zip(names, refs)
                             if r() is not None and not _destroyed_group(r())}),
            "checked": len(refs), "groups_before": groups_before,
            "groups_with_model": groups_with_model, "groups_after": live_groups()}


def all_paths(rank: int, world: int, directory: str) -> dict:
    """Every probe that runs at this world size; {path: run_probe's report}."""
    probes: dict[str, tuple] = {
        "FULL_SHARD": (probe_strategy, rank, world, "FULL_SHARD"),
        "SHARD_GRAD_OP": (probe_strategy, rank, world, "SHARD_GRAD_OP"),
        "NO_SHARD": (probe_strategy, rank, world, "NO_SHARD"),
        "HYBRID_SHARD": (probe_strategy, rank, world, "HYBRID_SHARD"),
        "verify": (probe_verify, rank, world),
        "unshard+no_sync": (probe_unshard_and_no_sync, rank, world),
        "replicate": (probe_replicate, rank, world),
        "block.compile": (probe_block_compile, rank, world),
        "compile_layers": (probe_compile_layers, rank, world),
        "torch.compile(model)": (probe_compile_model, rank, world, False),
        "torch.compile(model, fullgraph=True)": (probe_compile_model, rank, world, True),
        "activation checkpointing": (probe_checkpointing, rank, world),
        "last loss kept": (probe_last_loss_kept, rank, world, False),
        "last loss kept, torch.compile(model)": (probe_last_loss_kept, rank, world, True),
        "meta init": (probe_meta_init, rank, world),
        "checkpoint save/load/full_state_dict": (probe_checkpoint, rank, world, directory, False),
        "checkpoint background save": (probe_checkpoint, rank, world, directory, True),
    }
    if world >= 4:
        probes["int reshard"] = (probe_int_reshard, rank, world)
    return {name: run_probe(*spec) for name, spec in probes.items()}


def rss_bytes() -> int:
    """This process's resident memory now (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def rounds(rank: int, world: int, n_rounds: int, width: int) -> dict:
    """Build / shard / train a step / delete, n_rounds times: live tensor bytes and RSS per round
    after the delete, tensor bytes while the model lived (the probe sees tensors), group counts."""
    tensor_bytes, rss, groups, with_model, meshes_alive = [], [], [], [], []
    last_mesh = None
    for _ in range(n_rounds):
        torch.manual_seed(0)
        model = shardkit.shard(torch.nn.Sequential(*[torch.nn.Linear(width, width)
                                                     for _ in range(4)]),
                               auto_wrap_policy=lambda m: isinstance(m, torch.nn.Linear),
                               strategy="HYBRID_SHARD", hybrid_group_size=max(1, world // 2))
        gc.collect()
        meshes_alive.append(last_mesh is not None and last_mesh() is not None)
        last_mesh = weakref.ref(model[0].weight.device_mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(2, width)).sum().backward()
        optimizer.step()
        with_model.append(live_tensor_bytes())
        refs = [weakref.ref(model), weakref.ref(optimizer)]
        del model, optimizer
        collect(refs)
        tensor_bytes.append(live_tensor_bytes())
        rss.append(rss_bytes())
        groups.append(live_groups())
    return {"tensor_bytes": tensor_bytes, "rss": rss, "groups": groups,
            "tensor_bytes_with_model": with_model, "model_bytes": 4 * (width * width + width) * 4,
            "earlier_mesh_alive_after_next_shard": meshes_alive}


def gpu_rounds(rank: int, world: int, n: int) -> list[tuple[int, int]]:
    """A warm-up round, then n rounds of 8 x Linear(4096, 4096) with AdamW on the GPU: for each,
    (bytes allocated with the model, bytes allocated after its delete) above the baseline taken
    after the warm-up (which leaves cuBLAS workspaces on the streams it used, held for the process)."""
    out = []
    for _ in range(n + 1):
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated() if out else None
        model = shardkit.shard(torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)]),
                               auto_wrap_policy=lambda m: isinstance(m, torch.nn.Linear))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(8, 4096, device=shardkit.current_context().device)).sum().backward()
        optimizer.step()
        torch.cuda.synchronize()
        with_model = torch.cuda.memory_allocated()
        refs = [weakref.ref(model), weakref.ref(optimizer)]
        del model, optimizer
        collect(refs)
        torch.cuda.synchronize()
        if baseline is None:
            out.append((0, 0))  # the warm-up round: only sets the baseline
            continue
        out.append((with_model - baseline, torch.cuda.memory_allocated() - baseline))
    return out[1:]
