"""A rank killed at a chosen point inside checkpoint.save() (module-level so spawn can pickle it)."""

from __future__ import annotations

import importlib
import os
import signal

import torch
import torch.nn.functional as F

import shardkit

from _models import Block, TinyNet, batch

# (module, function, when, calls): places one save passes through, and how many times it passes
# each at least. Every rank writes shard files, hashes some files and merges the digests; rank 0
# alone creates the temporary directory, writes the state file and the manifest, and renames
# directories into place (the previous checkpoint aside, then the new one in).
EVERY_RANK = [
    ("torch.distributed.checkpoint.filesystem", "_write_item", "before", 2),
    ("torch.distributed.checkpoint.filesystem", "_write_item", "after", 2),
    ("shardkit.checkpoint.manifest", "sha256_file", "after", 1),
    ("shardkit.checkpoint.collective", "merge_digests", "before", 1),
]
RANK0_ONLY = [
    ("shardkit.checkpoint.sharded", "_make_tmp", "after", 1),
    ("shardkit.checkpoint.sharded", "_write_synced", "before", 1),
    ("shardkit.checkpoint.sharded", "_write_synced", "after", 1),
    ("shardkit.checkpoint.manifest", "write_manifest", "after", 1),
    ("os", "rename", "before", 2),
    ("os", "rename", "after", 2),
]


def kill_points(rank: int) -> list[tuple[str, str, str, int]]:
    """The places where `rank` can be killed during a save."""
    return EVERY_RANK + (RANK0_ONLY if rank == 0 else [])


def _kill_at(module_name: str, name: str, when: str, call: int) -> None:
    """Replace module.name so that its `call`-th call SIGKILLs this process (before or after it runs)."""
    module = importlib.import_module(module_name)
    original = getattr(module, name)
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        last = calls[0] == call
        if last and when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        result = original(*args, **kwargs)
        if last:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    setattr(module, name, wrapper)


def _step(model, opt, step: int, rank: int) -> None:
    x, y = batch(step, rank)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def save_then_die(rank: int, world: int, root: str, victim: int, point: tuple, call: int) -> None:
    """Save a checkpoint at step 1, then again at step 2 with `victim` killed at `point`."""
    ck = shardkit.checkpoint
    torch.manual_seed(0)
    model = shardkit.shard(TinyNet(), auto_wrap_policy=shardkit.wrap.transformer_layers({Block}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    path = os.path.join(root, "ckpt")
    for step in (1, 2):
        _step(model, opt, step, rank)
        state = ck.full_state_dict(model)
        if rank == 0:
            torch.save(state, os.path.join(root, f"state{step}.pt"))
        if step == 2 and rank == victim:
            _kill_at(*point[:3], call)
        ck.save(path, model, opt, extra={"step": step})
