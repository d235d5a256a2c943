"""A rank SIGKILLed anywhere inside checkpoint.save(): the last complete checkpoint always loads.

Seeded random kill points over every rank; each run saves at step 1, then dies saving step 2.
Afterwards the checkpoint path holds step 1 or (when the kill came after the final rename)
step 2, its files verify against the manifest, and an unfinished directory is refused as
incomplete (or, killed after its manifest but before its rename, holds the complete step 2).
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from safetensors.torch import load_file

import shardkit
from shardkit import checkpoint as ck
from shardkit.job.spawn import SpawnError

from _save_kill_workers import kill_points, save_then_die

SEED = 20261123
# (world size, victim): every rank of a 2- and a 3-rank job is killed in some run.
RUNS = [(2, 0), (2, 1), (3, 1), (3, 2), (3, 0), (2, 0)]


def _plan():
    rng = random.Random(SEED)
    plan = []
    for world, victim in RUNS:
        point = rng.choice(kill_points(victim))
        plan.append((world, victim, point, rng.randint(1, point[3])))
    return plan


@pytest.mark.slow
@pytest.mark.parametrize("world,victim,point,call", _plan(),
                         ids=[f"{w}ranks-kill{v}-{p[1]}-{p[2]}-call{c}" for w, v, p, c in _plan()])
def test_kill_during_save_keeps_a_loadable_checkpoint(tmp_path, world, victim, point, call):
    root = str(tmp_path)
    with pytest.raises(SpawnError) as info:
        shardkit.spawn(save_then_die, world, world, root, victim, point, call,
                       threads_per_rank=1, timeout=10)
    assert info.value.exitcodes[victim] == -9, str(info.value)  # the kill point was reached
    path = os.path.join(root, "ckpt")
    meta = ck.inspect_checkpoint(path)
    assert meta["step"] in (1, 2)
    _assert_holds(path, os.path.join(root, "consolidated"), os.path.join(root, f"state{meta['step']}.pt"))
    for name in os.listdir(root):
        if name.startswith("ckpt.tmp-"):
            unfinished = os.path.join(root, name)
            try:
                ck.inspect_checkpoint(unfinished)
            except ck.IncompleteCheckpointError:
                continue
            # Killed between writing the manifest and renaming: a complete step-2 checkpoint that
            # was never moved into place (the path itself resolved to the previous one above).
            _assert_holds(unfinished, os.path.join(root, "unfinished"),
                          os.path.join(root, "state2.pt"))


def _assert_holds(checkpoint: str, out: str, state_file: str) -> None:
    """The checkpoint verifies (sizes, sha256) and holds exactly the saved full state."""
    ck.consolidate(checkpoint, out)
    got = {}
    for f in sorted(f for f in os.listdir(out) if f.endswith(".safetensors")):
        got.update(load_file(os.path.join(out, f)))
    want = torch.load(state_file, weights_only=True)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key
