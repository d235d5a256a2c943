"""Per-rank workers for the FSDP2-style control knobs: reshard_after_forward (bool / int / per
unit), explicit prefetch, and set_requires_gradient_sync (module level so shardkit.spawn can pickle)."""

from __future__ import annotations


import torch
import torch.nn.functional as F

import shardkit
from shardkit.sharding import get_state, shard_views

from _models import Block, TinyNet, batch
from _sharding_workers import (LazyLikeCPU, mp_parity_run, parity_run, spawn_suite,
                              swapped_capabilities)

MIXED = {"blocks.0": 2, "blocks.1": False, "<root>": True}  # one unit of each kind at world 4


def _shard(model, strategy="FULL_SHARD", **kwargs):
    return shardkit.shard(model, strategy=strategy,
                          auto_wrap_policy=shardkit.wrap.transformer_layers({Block}), **kwargs)


def _layout(model) -> list[dict]:
    """Per parameter: name, numel, padded numel, trainable (what the byte and memory formulas need)."""
    return [{"fqn": v.fqn, "numel": v.full_shape.numel(),
             "padded": v.shard_numel * v.shard_group.size, "trainable": v.requires_grad}
            for v in shard_views(model)]


def held_gathered_bytes(model) -> int:
    """Bytes of gathered parameter memory the engine holds: full buffers plus kept 1/k slices."""
    total = 0
    for unit in get_state(model).units:
        total += sum(t.untyped_storage().nbytes() for t in unit.partial_rows.values())
        total += sum(p.unsharded_flat.untyped_storage().nbytes() for p in unit.params)
    return total


def held_grad_bytes(model) -> int:
    """Bytes of unreduced (unsharded) gradients the engine holds."""
    return sum(p.unsharded.grad.untyped_storage().nbytes()
               for p in get_state(model).iter_params() if p.unsharded.grad is not None)


def reshard_bytes_and_memory(rank: int, spec, mp: shardkit.MixedPrecision | None = None,
                             strategy: str = "FULL_SHARD") -> dict:
    """One step: bytes each collective sent in forward and in backward, and the gathered bytes
    held between them (and after backward)."""
    torch.manual_seed(0)
    model = _shard(TinyNet(), strategy, reshard_after_forward=spec, mixed_precision=mp)
    shardkit.comm_stats(model, reset=True)
    x, y = batch(0, rank)
    loss = F.cross_entropy(model(x), y)
    out = {"layout": _layout(model), "forward": shardkit.comm_stats(model, reset=True),
           "held_between": held_gathered_bytes(model)}
    loss.backward()
    out["backward"] = shardkit.comm_stats(model, reset=True)
    out["held_after"] = held_gathered_bytes(model)
    return out


def reshard_errors() -> dict:
    """The message shard() gives for each invalid reshard_after_forward (None when it accepted it)."""
    out = {}
    for name, strategy, spec in [("not_divisor", "FULL_SHARD", 3), ("zero", "FULL_SHARD", 0),
                                 ("no_shard", "NO_SHARD", 2), ("unknown_unit", "FULL_SHARD",
                                                               {"blocks.7": 2}),
                                 ("bad_type", "FULL_SHARD", "two"),
                                 ("per_unit_bad", "FULL_SHARD", lambda name, m: 3)]:
        try:
            _shard(TinyNet(), strategy, reshard_after_forward=spec)
            out[name] = None
        except shardkit.ShardkitError as exc:
            out[name] = str(exc)
    return out


def _explicit_prefetch(model) -> None:
    """Forward: the root prefetches blocks.1 (not blocks.0), blocks.0 nothing. Backward: the root
    prefetches blocks.0 (not blocks.1), blocks.1 nothing (the default order would be the reverse)."""
    model.set_forward_prefetch(model, [model.blocks[1]])
    model.set_forward_prefetch("blocks.0", [])
    model.set_backward_prefetch("<root>", ["blocks.0"])
    model.set_backward_prefetch(model.blocks[1], [])


def prefetch_order(rank: int, explicit: bool) -> dict:
    """The order units' all-gathers are issued in (forward, then backward) on the 2nd step."""
    torch.manual_seed(0)
    model = _shard(TinyNet())
    if explicit:
        _explicit_prefetch(model)
    issued: list[str] = []
    for unit in get_state(model).units:
        def spy(async_op=True, u=unit, real=unit.unshard):
            if u.sharded_state.name in ("SHARDED", "PARTIAL"):  # only calls that gather
                issued.append(u.name)
            real(async_op)
        unit.unshard = spy
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    orders = []
    for step in range(2):
        issued.clear()
        x, y = batch(step, rank)
        loss = F.cross_entropy(model(x), y)
        forward = list(issued)
        issued.clear()
        loss.backward()
        orders.append({"forward": forward, "backward": list(issued)})
        opt.step()
        opt.zero_grad()
    out = {"orders": orders, "peak": shardkit.comm_stats(model)["peak_prefetch_in_flight"],
           "errors": {}}
    for name, call in [("not_a_unit", lambda: model.set_forward_prefetch(model.blocks[0].fc1, [])),
                       ("listed_not_a_unit", lambda: model.set_backward_prefetch(model, [model.head])),
                       ("unknown_name", lambda: model.set_forward_prefetch("blocks.9", [])),
                       ("not_a_list", lambda: model.set_forward_prefetch(model, model.blocks[0])),
                       ("sync_not_bool", lambda: model.set_requires_gradient_sync(0))]:
        try:
            call()
            out["errors"][name] = None
        except shardkit.ShardkitError as exc:
            out["errors"][name] = str(exc)
    return out


def grad_sync_bytes_and_memory(rank: int, micro: int = 3) -> dict:
    """Micro-batches under set_requires_gradient_sync(False), then one synced: bytes per
    micro-batch, unreduced grad bytes held between micro-batches, sharded grads present."""
    torch.manual_seed(0)
    model = _shard(TinyNet())
    out: dict = {"layout": _layout(model), "steps": []}
    shardkit.comm_stats(model, reset=True)
    for j in range(micro):
        model.set_requires_gradient_sync(j == micro - 1)
        x, y = batch(j, rank)
        F.cross_entropy(model(x), y).backward()
        out["steps"].append({"stats": shardkit.comm_stats(model, reset=True),
                             "held_grads": held_grad_bytes(model),
                             "sharded_grads": sum(p.grad is not None for p in model.parameters())})
    return out


def _checkpoint_blocks(model) -> None:
    """Activation checkpointing: backward recomputes each block from its re-gathered params."""
    shardkit.wrap.checkpoint_layers(model, Block)


def _mixed_by_name(name: str, module) -> object:
    """Per-unit callable: blocks reshard to 2 ranks, the root stays gathered (FSDP2's last-unit tip)."""
    return False if name == "<root>" else 2


def knobs_suite(rank: int, world: int) -> dict:
    """Every knob check that runs at this world size (inside the sharding tests' shared spawn)."""
    bf16 = shardkit.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    out: dict = {}
    if world == 4:
        out["parity"] = {
            "k2": parity_run(rank, "FULL_SHARD", world, {"reshard_after_forward": 2}),
            "dict": parity_run(rank, "FULL_SHARD", world, {"reshard_after_forward": MIXED}),
            "callable": parity_run(rank, "FULL_SHARD", world,
                                   {"reshard_after_forward": _mixed_by_name}),
            "k2_no_sync": parity_run(rank, "FULL_SHARD", world, {"reshard_after_forward": 2},
                                     micro=2),
            "k2_checkpointed": parity_run(rank, "FULL_SHARD", world, {"reshard_after_forward": 2},
                                          setup=_checkpoint_blocks),
        }
        out["mp_k2"] = mp_parity_run(rank, world, shard_kwargs={"reshard_after_forward": 2})
        out["bytes"] = {"k2": reshard_bytes_and_memory(rank, 2),
                        "dict": reshard_bytes_and_memory(rank, MIXED),
                        "k2_bf16": reshard_bytes_and_memory(rank, 2, bf16)}
        out["errors"] = reshard_errors()
        out["lazy_like"] = lazy_like_knobs(rank, world)
    if world == 2:
        out["parity"] = {
            "k1": parity_run(rank, "FULL_SHARD", world, {"reshard_after_forward": 1}),
            "k2": parity_run(rank, "FULL_SHARD", world, {"reshard_after_forward": 2}),
            "explicit_prefetch": parity_run(rank, "FULL_SHARD", world, setup=_explicit_prefetch),
            "grad_sync_flag": parity_run(rank, "FULL_SHARD", world, micro=3, sync_flag=True),
        }
        out["mp_callable"] = mp_parity_run(rank, world,
                                           shard_kwargs={"reshard_after_forward": _mixed_by_name})
        out["bytes"] = {"k1": reshard_bytes_and_memory(rank, 1),
                        "k2": reshard_bytes_and_memory(rank, 2)}
        out["prefetch"] = {"default": prefetch_order(rank, explicit=False),
                           "explicit": prefetch_order(rank, explicit=True)}
        out["grad_sync"] = grad_sync_bytes_and_memory(rank)
    return out


def lazy_like_capabilities():
    """Make the running gloo backend declare what LazyLikeCPU (a lazy-tensor device) declares: no
    storage resize, synchronous collectives, compiler barriers, 4-element alignment."""
    return swapped_capabilities(LazyLikeCPU.capabilities)


def lazy_like_knobs(rank: int, world: int) -> dict:
    """reshard_after_forward=2 without storage resize (the kept slices are fresh tensors)."""
    with lazy_like_capabilities() as be:
        return {"resize": be.capabilities.supports_storage_resize,
                "parity": parity_run(rank, "FULL_SHARD", world, {"reshard_after_forward": 2}),
                "bytes": reshard_bytes_and_memory(rank, 2)}


def spawn_knobs(world: int) -> list[dict]:
    """`knobs_suite`'s results on `world` ranks, from the sharding tests' shared spawn."""
    return [r["knobs"] for r in spawn_suite(world)]

