"""The per-rank training loop behind `shardkit demo` and its single entry point `run_demo`."""

from __future__ import annotations

import sys
import time
from dataclasses import asdict

import torch
import torch.nn.functional as F
from torch import nn

from ..seeding import seeded
from .config import DEFAULT_LR, DemoConfig
from .data import batches, load_digits_28, rank_indices, rank_slice
from .memory import measured_state_bytes, unsharded_state_bytes
from .models import build_model, count_params

LR_DECAY = 0.7  # the tutorial's StepLR(step_size=1, gamma=0.7)
PRECISIONS = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _mixed_precision(shardkit, backend, name: str):
    dtype = PRECISIONS[name]
    if dtype is None:
        return None
    if not backend.devices.supports_dtype(dtype):
        raise shardkit.ShardkitError(
            f"backend {backend.name!r} cannot compute in {dtype}; HINT: run with "
            "--mixed-precision none or pick a backend that supports it")
    # Reductions stay in fp32 so gradient sums do not lose the small contributions.
    return shardkit.MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32,
                                   buffer_dtype=dtype)


def _shard(model: nn.Module, cfg: DemoConfig, ctx) -> nn.Module:
    import shardkit

    return shardkit.shard(model, strategy=shardkit.ShardingStrategy[cfg.strategy.upper()],
                          auto_wrap_policy=shardkit.wrap.transformer_layers({nn.Conv2d, nn.Linear}),
                          mixed_precision=_mixed_precision(shardkit, ctx.backend,
                                                           cfg.mixed_precision),
                          hybrid_group_size=cfg.hybrid_group_size, backend=ctx.backend)


def _optimizer(model: nn.Module, cfg: DemoConfig) -> torch.optim.Optimizer:
    lr = cfg.lr if cfg.lr is not None else DEFAULT_LR[cfg.optimizer]
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr)
    return torch.optim.Adadelta(model.parameters(), lr=lr)


def _all_sum(ctx, values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    ctx.backend.collectives.all_reduce(t, ctx.world, op="sum").wait()
    return t.tolist()


@torch.no_grad()
def _evaluate(model: nn.Module, test, ctx) -> float:
    """Test accuracy over the whole test set; each rank scores its own slice in one forward."""
    model.eval()
    part = rank_slice(len(test), ctx.rank, ctx.world_size)
    logits = model(test.images[part].to(ctx.device))
    correct = (logits.argmax(1).cpu() == test.labels[part]).sum().item()
    correct, total = _all_sum(ctx, [correct, part.stop - part.start])
    return correct / total


def _train_epoch(model, opt, train, cfg: DemoConfig, ctx, epoch: int) -> tuple[float, int]:
    """One pass over this rank's share of the data: (mean train loss over all ranks, steps)."""
    model.train()
    order = rank_indices(len(train), ctx.rank, ctx.world_size, epoch, cfg.seed)
    steps = -(-order.numel() // cfg.batch_size)
    bar = None
    if ctx.rank == 0 and cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=steps, desc=f"epoch {epoch + 1}/{cfg.epochs}", unit="step",
                   leave=False, file=sys.stderr, dynamic_ncols=True,
                   disable=None)  # None: a bar on terminals, silence in logs
    loss_sum, seen = 0.0, 0
    for x, y in batches(train, order, cfg.batch_size):
        x, y = x.to(ctx.device), y.to(ctx.device)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        ctx.backend.devices.step_boundary()  # lazy backends (XLA) cut their graph here; a no-op elsewhere
        loss_sum += loss.item() * y.numel()
        seen += y.numel()
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}")
    if bar is not None:
        bar.close()
    total_loss, total_seen = _all_sum(ctx, [loss_sum, seen])
    return total_loss / total_seen, steps


def train_rank(rank: int, cfg: DemoConfig) -> dict:
    """Train and evaluate on this rank (run under shardkit.spawn); return its figures."""
    import shardkit
    from shardkit.job.runtime import require_context

    ctx = require_context()  # made by shardkit.spawn
    train, test = load_digits_28(cfg.limit_train)
    # Taken after the data and its libraries are loaded, so peak - start is what training added.
    start_bytes = ctx.backend.devices.memory_stats(ctx.device)["allocated"]
    with seeded(cfg.seed):  # one model on every rank, also when ranks are threads (XLA)
        model = build_model(cfg.model)
    num_params = count_params(model)
    model = _shard(model, cfg, ctx)
    opt = _optimizer(model, cfg)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=LR_DECAY)
    history = []
    sent: dict[str, float] = {}
    steps = 0
    t0 = time.perf_counter()
    for epoch in range(cfg.epochs):
        t_epoch = time.perf_counter()
        shardkit.comm_stats(model, reset=True)  # count training steps only, not evaluation
        loss, epoch_steps = _train_epoch(model, opt, train, cfg, ctx, epoch)
        steps += epoch_steps
        for kind, nbytes in shardkit.comm_stats(model).items():
            if isinstance(nbytes, int):
                sent[kind] = sent.get(kind, 0) + nbytes
        sched.step()
        acc = _evaluate(model, test, ctx)
        history.append({"epoch": epoch + 1, "train_loss": loss, "test_accuracy": acc})
        if rank == 0:
            print(f"epoch {epoch + 1}/{cfg.epochs}  train loss {loss:.4f}  "
                  f"test accuracy {acc * 100:.2f}%  ({time.perf_counter() - t_epoch:.1f} s)",
                  flush=True)
    # Gradients of the last step are still alive here, so this is the steady-state footprint.
    state = measured_state_bytes(opt)
    memory = {"state_bytes": state["total"], "state_breakdown": state,
              "unsharded_formula_bytes": unsharded_state_bytes(num_params, cfg.optimizer),
              "peak_bytes": ctx.backend.devices.memory_stats(ctx.device)["peak"],
              "start_bytes": start_bytes}
    from ..sharding import sharding_info

    info = sharding_info(model)
    return {"rank": rank, "world_size": ctx.world_size, "num_params": num_params,
            "sent_per_step": {kind: nbytes / max(steps, 1) for kind, nbytes in sent.items()},
            "groups": {"shard": info["shard_group_size"], "replicas": info["replica_group_size"]},
            "device": str(ctx.device), "history": history, "memory": memory,
            "train_seconds": time.perf_counter() - t0, "config": asdict(cfg)}


def default_threads(nproc: int) -> int:
    """One compute thread per core share, so ranks do not oversubscribe the machine."""
    from ..cli.launch import usable_cores

    return max(1, usable_cores() // nproc)


def run_demo(cfg: DemoConfig) -> list[dict]:
    """Launch cfg.nproc local ranks with shardkit.spawn and return each rank's figures."""
    import shardkit

    threads = cfg.threads_per_rank or default_threads(cfg.nproc)
    return shardkit.spawn(train_rank, cfg.nproc, cfg, backend=cfg.backend,
                          threads_per_rank=threads)
