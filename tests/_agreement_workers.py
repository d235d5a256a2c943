"""Per-rank programs for test_checkpoint_agreement.py: ranks that call save/load with different arguments."""

from __future__ import annotations

import os

import torch

import shardkit


def different_paths(rank: int, root: str, background: bool) -> dict:
    """Save where each rank's path differs (a timestamp read 1 s apart); then load likewise."""
    ck = shardkit.checkpoint
    with shardkit.seeded(0):
        model = shardkit.shard(torch.nn.Linear(64, 64))
    opt = torch.optim.AdamW(model.parameters())
    out: dict = {}
    try:
        handle = ck.save(os.path.join(root, f"run-{1000 + rank}"), model, opt, background=background)
        out["save"] = f"saved {handle}"
    except shardkit.ShardkitError as exc:
        out["save"] = str(exc)
    good = ck.save(os.path.join(root, "same"), model, opt)  # the ranks still work together
    out["good"] = os.path.basename(good)
    try:
        ck.load(os.path.join(root, "same" if rank == 0 else "other"), model, opt)
        out["load"] = "loaded"
    except shardkit.ShardkitError as exc:
        out["load"] = str(exc)
    try:
        ck.load(os.path.join(root, "same"), model, opt if rank == 0 else None)
        out["load_optimizer"] = "loaded"
    except shardkit.ShardkitError as exc:
        out["load_optimizer"] = str(exc)
    ck.load(os.path.join(root, "same"), model, opt)
    shardkit.init().barrier()
    out["entries"] = sorted(os.listdir(root))
    return out


def save_three(rank: int, root: str) -> None:
    """Checkpoints at steps 1, 2 and 3 of a small sharded model with AdamW."""
    with shardkit.seeded(0):
        model = shardkit.shard(torch.nn.Linear(64, 64))
    opt = torch.optim.AdamW(model.parameters())
    for step in (1, 2, 3):
        with torch.no_grad():
            model.weight.add_(1.0)
        shardkit.checkpoint.save(os.path.join(root, f"step_{step}"), model, opt,
                                 extra={"step": step})


def resume_verified(rank: int, root: str) -> dict:
    """latest(verify=True) in a running job (collective), then load what it chose."""
    with shardkit.seeded(0):
        model = shardkit.shard(torch.nn.Linear(64, 64))
    opt = torch.optim.AdamW(model.parameters())
    chosen = shardkit.checkpoint.latest(root, verify=True)
    step = shardkit.checkpoint.load(chosen, model, opt)["step"] if chosen else None
    return {"chosen": os.path.basename(chosen) if chosen else None, "step": step}


def bad_write_timeout(rank: int, root: str) -> dict:
    """SHARDKIT_CHECKPOINT_TIMEOUT=abc: a background save is refused up front; a sync one works."""
    with shardkit.seeded(0):
        model = shardkit.shard(torch.nn.Linear(8, 8))
    out = {"sync": os.path.basename(shardkit.checkpoint.save(os.path.join(root, "sync"), model))}
    try:
        shardkit.checkpoint.save(os.path.join(root, "bg"), model, background=True).wait()
        out["background"] = "saved"
    except shardkit.ShardkitError as exc:
        out["background"] = str(exc)
    out["entries"] = sorted(os.listdir(root))
    return out
