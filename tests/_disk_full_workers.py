"""Per-rank worker for test_checkpoint_disk_full.py (module-level so spawn can pickle it)."""

from __future__ import annotations

import os

import torch

import shardkit


def save_onto_a_full_disk(rank: int, root: str, filler: str, background: bool = False) -> dict:
    """Save a 1 MB checkpoint, fill the file system but 64 KiB, save again (in the background, or
    not): the error, what survived and what was left beside the checkpoint."""
    ck = shardkit.checkpoint
    with shardkit.seeded(0):
        model = shardkit.shard(torch.nn.Linear(512, 512))
    path = os.path.join(root, "ckpt")
    ck.save(path, model, extra={"step": 1})
    saved = {k: v.clone() for k, v in ck.full_state_dict(model).items()}
    if rank == 0:  # the next save runs out part way through writing a tensor
        with open(filler, "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError:
                pass
        os.truncate(filler, os.path.getsize(filler) - 64 * 1024)
    shardkit.init().barrier()
    with torch.no_grad():
        model.weight.add_(1.0)
    out: dict = {}
    try:
        if background:
            ck.save(path, model, extra={"step": 2}, background=True).wait()
        else:
            ck.save(path, model, extra={"step": 2})
        out["error"] = None
    except shardkit.ShardkitError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    shardkit.init().barrier()
    # A failed background save's report (<tmp>.failed) may stay: the next save removes it.
    out["left_over"] = sorted(name for name in os.listdir(root) if name not in ("ckpt", "filler")
                              and not name.endswith(".failed"))
    shardkit.init().barrier()
    if rank == 0:
        os.remove(filler)
    shardkit.init().barrier()
    extra = ck.load(path, model)
    loaded = ck.full_state_dict(model)
    out["intact"] = extra["step"] == 1 and all(torch.equal(loaded[k], saved[k]) for k in saved)
    return out
