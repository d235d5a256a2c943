"""Per-rank workers for the XLA lane (module-level so shardkit.spawn can pickle them).

Ranks are torch_xla device threads of one process here, so anything process-global (torch's
default RNG) is used under a lock, and the unsharded reference trains eagerly on the CPU.
"""

from __future__ import annotations

import copy
import threading
import time

import torch
import torch.nn.functional as F

import shardkit
from shardkit.sharding import iter_unit_full_params

from _models import Block, TinyNet, batch, global_batch

STEPS = 5
_RNG_LOCK = threading.Lock()  # device threads share torch's default generator


def reference_and_copy(seed: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(eager-CPU reference, identical copy to shard), built from one seed."""
    with _RNG_LOCK:
        torch.manual_seed(seed)
        ref = TinyNet()
    return ref, copy.deepcopy(ref)


def max_diff_to(model: torch.nn.Module, ref: torch.nn.Module) -> float:
    """Largest |sharded - reference| over every parameter (gathers: every rank must call it)."""
    full: dict[str, torch.Tensor] = {}
    for _, tensors in iter_unit_full_params(model):
        full.update({k: v.detach().cpu() for k, v in tensors.items()})
    return max((full[k] - p.detach()).abs().max().item() for k, p in ref.named_parameters())


def compile_count() -> int:
    """Graphs torch_xla has compiled in this process so far (all device threads together)."""
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return int(data[0]) if data else 0


def engine_parity(rank: int, world: int, strategy: str, optimizer: str) -> dict:
    """Train sharded on XLA and unsharded on CPU (global batch) side by side; per-step differences."""
    ctx = shardkit.current_context()
    ref, model = reference_and_copy(seed=0)
    model = shardkit.shard(model, strategy=strategy,
                           auto_wrap_policy=shardkit.wrap.transformer_layers({Block}))
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
            "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2)}[optimizer]
    opt, ref_opt = make(model.parameters()), make(ref.parameters())
    out = {"init_diff": max_diff_to(model, ref), "diffs": [], "losses": [], "ref_losses": [],
           "devices": sorted({str(p.device) for p in model.parameters()}),
           "device": str(ctx.device), "world": ctx.world_size, "step_s": [],
           "compiles": []}
    for step in range(STEPS):
        started = time.perf_counter()
        x, y = (t.to(ctx.device) for t in batch(step, rank))
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()  # no step_boundary(): the backend's optimizer post-hook cuts the graph
        opt.zero_grad()
        gx, gy = global_batch(step, world)
        ref_loss = F.cross_entropy(ref(gx), gy)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        out["losses"].append(loss.item())
        out["ref_losses"].append(ref_loss.item())
        out["step_s"].append(round(time.perf_counter() - started, 2))
        out["compiles"].append(compile_count())
        out["diffs"].append(max_diff_to(model, ref))
    return out


def replicate_parity(rank: int, world: int) -> dict:
    """DDP through shardkit.replicate on XLA vs the unsharded CPU reference."""
    ref, model = reference_and_copy(seed=1)
    ddp = shardkit.replicate(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    dev = shardkit.current_context().device
    out = {"gradient_as_bucket_view": ddp.gradient_as_bucket_view, "diffs": []}
    for step in range(STEPS):
        x, y = (t.to(dev) for t in batch(step, rank))
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
        gx, gy = global_batch(step, world)
        F.cross_entropy(ref(gx), gy).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        out["diffs"].append(max((p.detach().cpu() - q.detach()).abs().max().item()
                                for p, q in zip(ddp.module.parameters(), ref.parameters())))
    return out


def replicate_refused(rank: int) -> str:
    """What shardkit.replicate raises when the XLA ranks are threads of one process."""
    try:
        shardkit.replicate(TinyNet())
    except Exception as exc:  # noqa: BLE001 - the type and text are the result
        return f"{type(exc).__name__}: {exc}"
    return "nothing raised"
