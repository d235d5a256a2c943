"""Per-rank workers for the failure tests: one rank dies or raises at a chosen place in a step."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.nn.functional as F

import shardkit

from _models import Block, TinyNet, batch

FAIL_STEP = 2


class InjectedFailure(Exception):
    """The exception a victim rank raises on purpose."""


def _fail(kind: str, mark: str) -> None:
    with open(mark, "w") as f:
        f.write(repr(time.time()))
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise InjectedFailure("injected failure")


def train_until_failure(rank: int, world: int, strategy: str, victim: int, kind: str,
                        phase: str, mark: str) -> None:
    """Train a sharded TinyNet; at step FAIL_STEP the victim dies/raises in `phase`, the others go on."""
    torch.manual_seed(0)
    hybrid = {"hybrid_group_size": 2 if world % 2 == 0 else world} if strategy == "HYBRID_SHARD" else {}
    model = shardkit.shard(TinyNet(), strategy=strategy,
                           auto_wrap_policy=shardkit.wrap.transformer_layers({Block}), **hybrid)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    victim_now = False

    def in_forward(module, args):
        if victim_now and phase == "forward":
            _fail(kind, mark)

    model.blocks[1].register_forward_pre_hook(in_forward)
    for step in range(1000):  # survivors would loop "forever" without the failure handling
        victim_now = rank == victim and step == FAIL_STEP
        x, y = batch(step, rank)
        h = model(x)
        if victim_now and phase == "backward":
            h.register_hook(lambda grad: _fail(kind, mark))
        F.cross_entropy(h, y).backward()
        if victim_now and phase == "step":
            _fail(kind, mark)
        opt.step()
        opt.zero_grad()
