"""Per-rank workers: several ranks on one device, collectives through gloo ("cuda+gloo", or
"cpu+gloo" in CI), every strategy and feature against the one-process reference."""

from __future__ import annotations

import copy
import traceback

import torch
import torch.nn.functional as F

import shardkit

from _knob_workers import _checkpoint_blocks
from _models import Block, TinyNet, batch, global_batch
from _sharding_workers import STEPS, STRATEGIES, full_params, max_diff, mp_parity_run, parity_run


def _compile_blocks(model) -> None:
    """Each block compiled as users do, block.compile() (inductor)."""
    for module in model.modules():
        if isinstance(module, Block):
            module.compile()


def one_device_suite(rank: int, world: int) -> dict:
    """Every strategy, reshard_after_forward as an int, prefetch 1 and 2, cpu_offload, activation
    checkpointing, no_sync and bf16 (HYBRID at 4 ranks): each run's per-step weight differences
    from the same model trained unsharded in one process on the global batch."""
    ctx = shardkit.current_context()
    runs = {s: parity_run(rank, s, world) for s in STRATEGIES}
    runs["prefetch_1"] = parity_run(rank, "FULL_SHARD", world, {"prefetch": 1})
    runs["prefetch_2"] = parity_run(rank, "FULL_SHARD", world, {"prefetch": 2})
    runs["reshard_int"] = parity_run(rank, "FULL_SHARD", world,
                                     {"reshard_after_forward": 2 if world >= 4 else 1})
    runs["cpu_offload"] = parity_run(rank, "FULL_SHARD", world, {"cpu_offload": True})
    runs["checkpointed"] = parity_run(rank, "FULL_SHARD", world, setup=_checkpoint_blocks)
    runs["no_sync"] = parity_run(rank, "FULL_SHARD", world, micro=2)
    if world == 4:
        hybrid = {"hybrid_group_size": 2}
        runs["HYBRID_SHARD"] = parity_run(rank, "HYBRID_SHARD", world, hybrid)
        runs["HYBRID_SHARD_no_sync"] = parity_run(rank, "HYBRID_SHARD", world, hybrid, micro=2)
    return {"backend": ctx.backend.name, "device": str(ctx.device),
            "runs": {name: {"init_diff": r["init_diff"], "diffs": r["diffs"], "devices": r["devices"]}
                     for name, r in runs.items()},
            "bf16": mp_parity_run(rank, world), "split_noise": split_batch_noise(world)}


def split_batch_noise(world: int) -> float:
    """How far the unsharded reference drifts from itself, unsharded too, when each step's global
    batch is split into the ranks' batches and their mean gradients averaged (the same math as
    data parallelism, in another order): this device's rounding floor for the parity runs. AdamW
    divides by the root of each gradient's square, so a gradient that cancels to near zero turns
    rounding into a visible step difference."""
    dev = shardkit.current_context().device
    torch.manual_seed(0)
    whole = TinyNet().to(dev)
    split = copy.deepcopy(whole)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (whole, split)]
    worst = 0.0
    for step in range(STEPS):
        gx, gy = (t.to(dev) for t in global_batch(step, world))
        F.cross_entropy(whole(gx), gy).backward()
        for r in range(world):
            x, y = (t.to(dev) for t in batch(step, r))
            (F.cross_entropy(split(x), y) / world).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        worst = max(worst, max((a - b).abs().max().item()
                               for a, b in zip(whole.parameters(), split.parameters())))
    return worst


def compiled_blocks_run(rank: int, world: int) -> dict:
    """FULL_SHARD with every block compiled by block.compile(), against the eager reference."""
    torch._dynamo.reset()
    run = parity_run(rank, "FULL_SHARD", world, setup=_compile_blocks)
    return {"init_diff": run["init_diff"], "diffs": run["diffs"]}


UNSYNCED_CONFIGS = {
    "FULL_SHARD": {},
    "SHARD_GRAD_OP": {"strategy": "SHARD_GRAD_OP"},
    "prefetch_2": {"prefetch": 2},
    "reshard_to_1": {"reshard_after_forward": 1},
    "bf16": {"mixed_precision": shardkit.MixedPrecision(param_dtype=torch.bfloat16,
                                                        reduce_dtype=torch.float32)},
    "cpu_offload": {"cpu_offload": True},
}


def unsynced_steps(rank: int, world: int, names: list[str], steps: int = 3) -> dict:
    """Per config of UNSYNCED_CONFIGS: steps with no host synchronisation between them (losses
    stay on the device), so that a missing stream wait is not hidden by a sync; under
    TORCH_CUDA_SANITIZER=1 a race raises. The weight difference from the unsharded reference
    (fp32 configs), or the error that stopped the run."""
    return {name: _unsynced(rank, world, UNSYNCED_CONFIGS[name], steps) for name in names}


def _unsynced(rank: int, world: int, options: dict, steps: int) -> dict:
    ctx = shardkit.current_context()
    dev = ctx.device
    torch.manual_seed(0)
    ref = TinyNet().to(dev)
    model = shardkit.shard(copy.deepcopy(ref), auto_wrap_policy=shardkit.wrap.transformer_layers({Block}),
                           **options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    try:
        for step in range(steps):
            x, y = (t.to(dev) for t in batch(step, rank))
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        ctx.backend.synchronize(dev)  # the sanitizer checks what is queued
    except Exception as exc:  # noqa: BLE001 - the sanitizer's report is the result
        return {"error": "".join(traceback.format_exception_only(exc))[:4000]}
    for step in range(steps):
        gx, gy = (t.to(dev) for t in global_batch(step, world))
        F.cross_entropy(ref(gx), gy).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return {"error": None, "diff": max_diff(full_params(model), ref)}
