"""Per-rank workers for torch.compile, activation checkpointing and profiler ranges under sharding."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import shardkit
from shardkit.wrap import checkpoint_layers, compile_layers, transformer_layers

from _models import Block, TinyNet, batch

STEPS = 5
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")


def _sharded(strategy: str, world: int) -> torch.nn.Module:
    torch.manual_seed(0)
    kwargs = {"hybrid_group_size": 1} if strategy == "HYBRID_SHARD" else {}
    return shardkit.shard(TinyNet(), strategy=strategy, auto_wrap_policy=transformer_layers({Block}),
                          **kwargs)


def _train(model: torch.nn.Module, rank: int, after_step=None) -> list[float]:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, rank)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if after_step is not None:
            after_step(step)
    return losses


def compile_run(rank: int, world: int) -> dict:
    """Every strategy eager and with each Block's forward compiled (aot_eager) after shard()."""
    from torch._dynamo.utils import counters

    out = {}
    for strategy in STRATEGIES:
        eager = _train(_sharded(strategy, world), rank)
        torch._dynamo.reset()
        counters.clear()
        model = _sharded(strategy, world)
        compiled = compile_layers(model, {Block}, backend="aot_eager")
        graphs: list[int] = []
        losses = _train(model, rank,
                        after_step=lambda step, graphs=graphs: graphs.append(counters["stats"]["unique_graphs"]))
        out[strategy] = {"eager": eager, "compiled": losses, "graphs_per_step": graphs,
                         "compiled_layers": len(compiled)}
    return out


def _grads_after_one_step(model: torch.nn.Module, rank: int) -> dict[str, torch.Tensor]:
    x, y = batch(0, rank)
    F.cross_entropy(model(x), y).backward()
    return {n: shardkit.full_tensor(p, p.grad) for n, p in model.named_parameters()}  # whole grads


def _saved_activation_bytes(model: torch.nn.Module, rank: int) -> int:
    """Bytes autograd saves for backward outside checkpointed regions (parameters excluded)."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if not isinstance(t, torch.nn.Parameter):
            total += t.numel() * t.element_size()
        return t

    x, y = batch(0, rank)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    model.zero_grad()
    return total


def checkpoint_run(rank: int, world: int) -> dict:
    """Grads with and without checkpoint_layers({Block}), saved bytes, and a few training losses."""
    out = {}
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        plain = _sharded(strategy, world)
        ac = _sharded(strategy, world)
        checkpoint_layers(ac, {Block})
        g_plain, g_ac = _grads_after_one_step(plain, rank), _grads_after_one_step(ac, rank)
        plain.zero_grad()
        ac.zero_grad()
        out[strategy] = {
            "grad_diff": max((g_plain[n] - g_ac[n]).abs().max().item() for n in g_plain),
            "saved_plain": _saved_activation_bytes(plain, rank),
            "saved_ac": _saved_activation_bytes(ac, rank),
            "losses_plain": _train(plain, rank), "losses_ac": _train(ac, rank)}
    return out


def profile_run(rank: int, world: int) -> dict:
    """Names of the profiler ranges one FULL_SHARD step records, and the no-profiler fast path."""
    from torch.profiler import ProfilerActivity, profile

    from shardkit.sharding.step.trace import trace_range

    model = _sharded("FULL_SHARD", world)
    _train(model, rank)  # warm-up (records the prefetch order)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        x, y = batch(0, rank)
        F.cross_entropy(model(x), y).backward()
    names = sorted({e.key for e in prof.key_averages() if e.key.startswith("shardkit::")})
    return {"names": names, "shared_noop": trace_range("a") is trace_range("b")}
