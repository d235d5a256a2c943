"""Ranks whose collective sequences diverge, with and without verification (module-level for spawn)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import shardkit

from _models import Block, TinyNet, batch
from _sharding_workers import full_params, max_diff

DIVERGE_STEP = 1


class BranchyNet(TinyNet):
    """TinyNet whose forward can skip its last block or leave `extra` unused, per call."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = torch.nn.Linear(14, 14)
        self.skip_last_block = False
        self.use_extra = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Like TinyNet, with the two switches."""
        h = self.embed(torch.relu(self.conv(x)).flatten(2).transpose(1, 2))
        blocks = self.blocks[:-1] if self.skip_last_block else self.blocks
        for block in blocks:
            h = block(h)
        if self.use_extra:
            h = h + self.extra(h)
        return self.head(self.norm(h).mean(dim=1))


def diverge(rank: int, world: int, case: str, verify: bool | None) -> dict:
    """Train 3 steps; at DIVERGE_STEP rank 0 alone does what `case` says. Returns grads and losses."""
    torch.manual_seed(0)
    ref = BranchyNet()
    model = shardkit.shard(copy.deepcopy(ref), auto_wrap_policy=shardkit.wrap.transformer_layers({Block}),
                           verify=verify)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    diffs = []
    for step in range(3):
        odd = step == DIVERGE_STEP
        if odd and case == "extra_forward" and rank == 0:
            with torch.no_grad():
                model(batch(100, rank)[0])
        model.skip_last_block = odd and case == "skipped_unit" and rank == 0
        model.use_extra = not (odd and case == "unused_param" and rank == 0)
        x, y = batch(step, rank)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        # Reference: every rank's batch through one replica with that rank's switches; mean grads.
        for r in range(world):
            ref.skip_last_block = odd and case == "skipped_unit" and r == 0
            ref.use_extra = not (odd and case == "unused_param" and r == 0)
            xr, yr = batch(step, r)
            (F.cross_entropy(ref(xr), yr) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        diffs.append(max_diff(full_params(model), ref))
    backend = model._shardkit_state.backend
    return {"diffs": diffs, "verified": getattr(backend, "verified_collectives", None)}


def two_verified_models(rank: int, world: int) -> dict:
    """A teacher and a student, both verified, used in turn (rank 1 lags behind on purpose, so
    one model's keys would be read as the other's if they shared them); both train like the
    reference."""
    import time

    torch.manual_seed(0)
    refs = [TinyNet(), TinyNet(dim=10)]  # other sizes: crossed keys would not match
    models = [shardkit.shard(copy.deepcopy(r), verify=True,
                             auto_wrap_policy=shardkit.wrap.transformer_layers({Block}))
              for r in refs]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    ref_opts = [torch.optim.SGD(r.parameters(), lr=0.1) for r in refs]
    for step in range(2):
        for i, (model, opt) in enumerate(zip(models, opts)):
            if rank == 1:
                time.sleep(0.3)
            x, y = batch(step * 2 + i, rank)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        for i, (ref, opt) in enumerate(zip(refs, ref_opts)):
            for r in range(world):
                x, y = batch(step * 2 + i, r)
                (F.cross_entropy(ref(x), y) / world).backward()
            opt.step()
            opt.zero_grad()
    verified = [m._shardkit_state.backend.verified_collectives for m in models]
    return {"diffs": [max_diff(full_params(m), r) for m, r in zip(models, refs)],
            "verified": verified}
