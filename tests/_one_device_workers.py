"""Per-rank workers: several ranks on one device, collectives through gloo ("cuda+gloo", or
"cpu+gloo" in CI), every strategy and feature against the one-process reference."""

from __future__ import annotations

import copy
import functools
import traceback

import torch
import torch.nn.functional as F

import shardkit

from _knob_workers import _checkpoint_blocks
from _models import Block, TinyNet, batch, global_batch
from _sharding_workers import STRATEGIES, full_params, max_diff, mp_parity_run, parity_run


def _compile_blocks(model) -> None:
    """Each block compiled as users do, block.compile() (inductor)."""
    for module in model.modules():
        if isinstance(module, Block):
            module.compile()


# SGD with momentum: AdamW divides each step by the gradient's magnitude, so where a gradient
# cancels to near zero it turns rounding into a step difference. On the H200 at 4 ranks AdamW
# runs differed from the reference by 1.7e-5, deterministically and the same for every
# FULL_SHARD variant (1.3e-5 NO_SHARD, 2.2e-5 HYBRID: each reduces in another order), while the
# same comparison with SGD differed by 4.5e-8 (benchmarks/README.md, issue 37).
SGD = {"optimizer": "sgd", "lr": 0.1}


def one_device_suite(rank: int, world: int) -> dict:
    """Every strategy, reshard_after_forward as an int, prefetch 1 and 2, cpu_offload, activation
    checkpointing, no_sync and bf16 (HYBRID at 4 ranks): each run's per-step weight differences
    from the same model trained unsharded in one process on the global batch."""
    ctx = shardkit.current_context()
    run = functools.partial(parity_run, rank, world=world, **SGD)
    runs = {s: run(s) for s in STRATEGIES}
    runs["prefetch_1"] = run("FULL_SHARD", shard_kwargs={"prefetch": 1})
    runs["prefetch_2"] = run("FULL_SHARD", shard_kwargs={"prefetch": 2})
    runs["reshard_int"] = run("FULL_SHARD",
                              shard_kwargs={"reshard_after_forward": 2 if world >= 4 else 1})
    runs["cpu_offload"] = run("FULL_SHARD", shard_kwargs={"cpu_offload": True})
    runs["checkpointed"] = run("FULL_SHARD", setup=_checkpoint_blocks)
    runs["no_sync"] = run("FULL_SHARD", micro=2)
    if world == 4:
        hybrid = {"hybrid_group_size": 2}
        runs["HYBRID_SHARD"] = run("HYBRID_SHARD", shard_kwargs=hybrid)
        runs["HYBRID_SHARD_no_sync"] = run("HYBRID_SHARD", shard_kwargs=hybrid, micro=2)
    return {"backend": ctx.backend.name, "device": str(ctx.device),
            "runs": {name: {"init_diff": r["init_diff"], "diffs": r["diffs"], "devices": r["devices"]}
                     for name, r in runs.items()},
            "bf16": mp_parity_run(rank, world)}


def compiled_blocks_run(rank: int, world: int) -> dict:
    """FULL_SHARD with every block compiled by block.compile(), against the eager reference."""
    torch._dynamo.reset()
    run = parity_run(rank, "FULL_SHARD", world, setup=_compile_blocks, **SGD)
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


def unsynced_steps(rank: int, world: int, names: list[str], steps: int = 3,
                   unordered_reduce: bool = False) -> dict:
    """Per config of UNSYNCED_CONFIGS: steps with no host synchronisation between them (losses
    stay on the device), so that a missing stream wait is not hidden by a sync; under
    TORCH_CUDA_SANITIZER=1 a race raises. The weight difference from the unsharded reference
    (fp32 configs), or the error that stopped the run. unordered_reduce: the deliberate break —
    the reduce stream stops waiting for the compute stream before its collective reads the
    packed gradients (a real race), so a test can show the sanitizer catches one."""
    return {name: _unsynced(rank, world, UNSYNCED_CONFIGS[name], steps, unordered_reduce)
            for name in names}


def _skip_reduce_stream_waits(model) -> None:
    """Make this model's reduce stream ignore wait_stream (test only: a missing ordering)."""
    from shardkit.sharding import get_state

    get_state(model).reduce_stream.wait_stream = lambda other: None


def _unsynced(rank: int, world: int, options: dict, steps: int, unordered_reduce: bool) -> dict:
    ctx = shardkit.current_context()
    dev = ctx.device
    torch.manual_seed(0)
    ref = TinyNet().to(dev)
    model = shardkit.shard(copy.deepcopy(ref), auto_wrap_policy=shardkit.wrap.transformer_layers({Block}),
                           **options)
    if unordered_reduce:
        _skip_reduce_stream_waits(model)
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
        # CUDASanitizerErrors says only how many; each of its errors says what raced.
        details = [str(e) for e in getattr(exc, "errors", [])]
        return {"error": "\n".join(["".join(traceback.format_exception_only(exc)), *details])[:4000]}
    for step in range(steps):
        gx, gy = (t.to(dev) for t in global_batch(step, world))
        F.cross_entropy(ref(gx), gy).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return {"error": None, "diff": max_diff(full_params(model), ref)}
