"""Per-rank programs for test_whole_params.py: DTensor parameters at their edges.

A model with a 0-d parameter (a learnable temperature: Replicate(), held by every rank), a
one-element parameter and a two-row one (at 3 ranks some ranks hold no rows of them), trained
with torch's own clip_grad_norm_ and AdamW against the same model unsharded on the global batch.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import shardkit

from _models import batch, global_batch


class EdgeNet(nn.Module):
    """conv features -> a (2, 16) projection -> a 1-element bias -> scaled by a 0-d temperature."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 3, padding=1)
        self.proj = nn.Linear(16, 2, bias=False)  # 2 rows: at 3 ranks rank 2 holds none
        self.shift = nn.Parameter(torch.tensor([0.25]))  # 1 row: only rank 0 holds it
        self.temperature = nn.Parameter(torch.tensor(1.5))  # 0-d: Replicate()
        self.head = nn.Linear(2, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (batch, 1, 4, 4) -> logits (batch, 5)."""
        h = self.proj(torch.relu(self.conv(x)).flatten(1)) + self.shift
        return self.head(torch.tanh(h)) * self.temperature


def whole(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (collective), a plain tensor itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _pair(strategy: str, hybrid: int | None) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    ref = EdgeNet()
    model = shardkit.shard(copy.deepcopy(ref), strategy=strategy, hybrid_group_size=hybrid,
                           auto_wrap_policy=lambda m: isinstance(m, (nn.Conv2d, nn.Linear)))
    return ref, model


def train_run(rank: int, world: int, strategy: str = "FULL_SHARD", hybrid: int | None = None,
              ckpt: str | None = None) -> dict:
    """12 clipped AdamW steps sharded and unsharded; placements, replicas and a checkpoint."""
    ref, model = _pair(strategy, hybrid)
    params = dict(model.named_parameters())
    out: dict = {
        "types": {n: type(p).__name__ for n, p in params.items()},
        "placements": {n: [str(pl) for pl in p.placements] for n, p in params.items()
                       if isinstance(p, DTensor)},
        "local_rows": {n: tuple(p.to_local().shape) for n, p in params.items()
                       if isinstance(p, DTensor)},
        "full_shapes": {n: tuple(p.shape) for n, p in params.items()},
        "numel": (sum(p.numel() for p in model.parameters()),
                  sum(p.numel() for p in ref.parameters())),
        "losses": [], "ref_losses": [], "norms": [], "ref_norms": []}
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1)
    for step in range(12):
        x, y = batch(step, rank)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        order = float("inf") if step % 2 else 2.0
        out["norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, order)))
        opt.step()
        opt.zero_grad()
        gx, gy = global_batch(step, world)
        ref_loss = F.cross_entropy(ref(gx), gy)
        ref_loss.backward()
        out["ref_norms"].append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5, order)))
        ref_opt.step()
        ref_opt.zero_grad()
        out["losses"].append(shardkit.global_mean(loss.item()))
        out["ref_losses"].append(ref_loss.item())
    ref_params = dict(ref.named_parameters())
    out["param_diff"] = max((whole(p.detach()) - ref_params[n]).abs().max().item()
                            for n, p in params.items())
    out["state_diff"] = max((whole(opt.state[p][key]) - ref_opt.state[ref_params[n]][key])
                            .abs().max().item()
                            for n, p in params.items() for key in ("exp_avg", "exp_avg_sq"))
    # Every rank's copy of the replicated temperature (and its optimizer state) is the same.
    mine = torch.stack([params["temperature"].detach().to_local(),
                        opt.state[params["temperature"]]["exp_avg"].to_local()]) \
        if isinstance(params["temperature"], DTensor) else torch.zeros(2)
    everyone = [torch.zeros(2) for _ in range(world)]
    torch.distributed.all_gather(everyone, mine)
    out["temperature_copies_equal"] = all(torch.equal(everyone[0], e) for e in everyone)
    from shardkit.sharding.surface.local_step import last_step_was_local

    out["local_step"] = last_step_was_local(opt)
    if ckpt is not None:  # with the whole parameters it saves, to compare a load with
        saved = {n: whole(p.detach()).clone() for n, p in params.items()}
        shardkit.checkpoint.save(ckpt, model, opt, extra={"saved": saved})
    return out


def load_run(rank: int, world: int, ckpt: str) -> dict:
    """Load the checkpoint train_run wrote (at another world size) and compare with its reference."""
    torch.manual_seed(5)
    model = shardkit.shard(EdgeNet(), auto_wrap_policy=lambda m: isinstance(m, (nn.Conv2d, nn.Linear)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    extra = shardkit.checkpoint.load(ckpt, model, opt)
    out = {"param_diff": max((whole(p.detach()) - extra["saved"][n]).abs().max().item()
                             for n, p in model.named_parameters()),
           "state_types": sorted({type(v).__name__ for s in opt.state.values() for k, v in s.items()
                                  if k != "step"})}
    # One more step runs (DTensor state and DTensor parameters agree) and the scalar stays shared.
    x, y = batch(50, rank)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    t = model.temperature.detach()
    mine = t.to_local().reshape(1) if isinstance(t, DTensor) else t.reshape(1)
    everyone = [torch.zeros(1) for _ in range(world)]
    torch.distributed.all_gather(everyone, mine)
    out["temperature_copies_equal"] = all(torch.equal(everyone[0], e) for e in everyone)
    return out


def state_dict_file_run(rank: int, world: int, tmp: str) -> dict:
    """torch.save(model.state_dict()) per rank, torch.load (weights_only) back into a fresh model."""
    ref, model = _pair("FULL_SHARD", None)
    path = os.path.join(tmp, f"sd-{rank}.pt")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.save(model.state_dict(), path)
    loaded = torch.load(path)  # torch's default: weights_only=True
    _, fresh = _pair("FULL_SHARD", None)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh.load_state_dict(loaded)
    ref_params = dict(ref.named_parameters())
    return {"types": sorted({type(v).__name__ for v in loaded.values()}),
            "diff": max((whole(p.detach()) - ref_params[n]).abs().max().item()
                        for n, p in fresh.named_parameters())}


def placements_expected(world: int, hybrid: int | None) -> dict[str, list[str]]:
    """What each EdgeNet parameter's placements must be under FULL_SHARD or HYBRID_SHARD (a shard
    group of one rank: Replicate() over the world, the whole parameter on every rank)."""
    rows, scalar = str(Shard(0)), str(Replicate())
    if world == 1 or hybrid == 1:  # a 1-D mesh over the world
        return {name: [scalar] for name in ("conv.weight", "conv.bias", "proj.weight", "shift",
                                            "temperature", "head.weight", "head.bias")}
    dims = (lambda p: [str(Replicate()), p]) if hybrid and world // hybrid > 1 else (lambda p: [p])
    return {"conv.weight": dims(rows), "conv.bias": dims(rows), "proj.weight": dims(rows),
            "shift": dims(rows), "temperature": dims(scalar), "head.weight": dims(rows),
            "head.bias": dims(rows)}
