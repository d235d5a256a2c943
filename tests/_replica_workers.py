"""Per-rank programs for test_replicas.py: ranks that built different values, with and without
shard(sync_module_states=True), and replicas that drift after shard()."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import shardkit

from _sharding_workers import full_params


class BNNet(nn.Module):
    """Linear -> BatchNorm (running stats: buffers) -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (batch, 6) -> (batch, 3)."""
        return self.out(torch.relu(self.bn(self.inp(x))))


def build(seed: int | None, meta: bool = False, draws: int = 0) -> nn.Module:
    """BNNet from `seed` (None: unseeded, after `draws` rank-dependent draws from torch's RNG)."""
    if seed is None:
        torch.rand(draws)  # what a data loader or dropout does before the model is built
    else:
        torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return BNNet()
    return BNNet()


def _error(call) -> str | None:
    try:
        call()
    except shardkit.ShardkitError as exc:
        return str(exc)
    return None


def replica_case(rank: int, world: int, strategy: str, seeds: list[int | None],
                 sync: bool | None = None, hybrid: int | None = None, meta: bool = False,
                 skew_buffer: bool = False) -> dict:
    """shard() a BNNet built from seeds[rank]; report the error or what the ranks hold."""
    model = build(seeds[rank], meta=meta, draws=rank + 1)
    if skew_buffer:
        model.bn.running_mean.add_(float(rank))  # a buffer only this rank changed
    out: dict = {}
    out["error"] = _error(lambda: out.setdefault("model", shardkit.shard(
        model, strategy=strategy, hybrid_group_size=hybrid, sync_module_states=sync,
        auto_wrap_policy=shardkit.wrap.transformer_layers({nn.Linear}))))
    if out["error"] is None:
        sharded = out.pop("model")
        ref = build(seeds[0])  # rank 0's model
        full = full_params(sharded)
        out["diff_to_rank0"] = max((full[n] - p.detach()).abs().max().item()
                                   for n, p in ref.named_parameters())
        out["buffers"] = {n: b.clone() for n, b in sharded.named_buffers()}
        out["ref_buffers"] = {n: b.clone() for n, b in ref.named_buffers()}
    out.pop("model", None)
    return out


def sync_trains_like_rank0(rank: int, world: int, strategy: str) -> dict:
    """Ranks seeded differently, sync_module_states=True: 3 SGD steps match rank 0's model
    trained unsharded on the global batch."""
    model = shardkit.shard(build(rank), strategy=strategy, sync_module_states=True)
    ref = build(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    diffs = []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4 * world, 6, generator=g), torch.randint(0, 3, (4 * world,), generator=g)
        # BatchNorm normalises per rank's batch, so the reference takes one rank's batch size per
        # forward and averages the ranks' losses: the gradient the ranks average.
        F.cross_entropy(model(x[4 * rank:4 * rank + 4]), y[4 * rank:4 * rank + 4]).backward()
        opt.step()
        opt.zero_grad()
        ref_losses = [F.cross_entropy(ref(x[4 * r:4 * r + 4]), y[4 * r:4 * r + 4])
                      for r in range(world)]
        (sum(ref_losses) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        diffs.append(max((full_params(model)[n] - p.detach()).abs().max().item()
                         for n, p in ref.named_parameters()))
    return {"diffs": diffs}


def drift_case(rank: int, world: int) -> dict:
    """NO_SHARD replicas made equal, then changed on one rank: check_replicas names it."""
    model = shardkit.shard(build(0), strategy="NO_SHARD")
    out = {"clean": _error(lambda: shardkit.check_replicas(model))}
    if rank == 1:
        with torch.no_grad():
            model.get_parameter("out.weight").add_(1.0)  # edited outside the optimizer
    out["param"] = _error(lambda: shardkit.check_replicas(model))
    with torch.no_grad():
        model.get_parameter("out.weight").fill_(1.0)  # equal again
        if rank == 1:
            model.bn.running_var.mul_(2.0)  # a buffer updated on one rank only
    out["buffer"] = _error(lambda: shardkit.check_replicas(model))
    # A module of an already sharded model is refused too.
    out["child"] = _error(lambda: shardkit.shard(model.out))
    return out
