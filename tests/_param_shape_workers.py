"""Per-rank programs for test_param_shapes.py: what training code sees of a sharded parameter."""

from __future__ import annotations

import copy
import os

import torch
import torch.nn.functional as F

import shardkit
from shardkit.sharding import get_state

from _models import Block, TinyNet, batch, global_batch
from _optim_state import assemble_optim, local_optim
from _sharding_workers import full_params, max_diff

STEPS = 5
FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "flat_shard_ckpt")


def _pair(strategy: str, hybrid: int | None = None) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(unsharded reference, sharded copy) of TinyNet with equal values."""
    torch.manual_seed(0)
    ref = TinyNet()
    model = shardkit.shard(copy.deepcopy(ref), strategy=strategy, hybrid_group_size=hybrid,
                           auto_wrap_policy=shardkit.wrap.transformer_layers({Block}))
    return ref, model


def nanogpt_groups(model: torch.nn.Module, decay: float) -> list[dict]:
    """nanoGPT's configure_optimizers rule: weight decay for every parameter with dim >= 2."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def hf_groups(model: torch.nn.Module, decay: float) -> list[dict]:
    """transformers' Trainer rule: decay all but LayerNorm weights and biases (by module and name)."""
    from transformers import Trainer

    names = set(Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if n in names], "weight_decay": decay},
            {"params": [p for n, p in named if n not in names], "weight_decay": 0.0}]


def _group_names(model: torch.nn.Module, groups: list[dict]) -> list[list[str]]:
    ids = {id(p): n for n, p in model.named_parameters()}
    return [sorted(ids[id(p)] for p in g["params"]) for g in groups]


def decay_rule_run(rank: int, world: int, rule: str, strategy: str = "FULL_SHARD") -> dict:
    """AdamW with a decay rule read from parameter shapes/names, sharded vs unsharded, 5 steps."""
    make = {"nanogpt": nanogpt_groups, "hf": hf_groups}[rule]
    ref, model = _pair(strategy)
    no_decay_ref = copy.deepcopy(ref)
    opt = torch.optim.AdamW(make(model, 1.0), lr=1e-2)
    ref_opt = torch.optim.AdamW(make(ref, 1.0), lr=1e-2)
    plain_opt = torch.optim.AdamW(no_decay_ref.parameters(), lr=1e-2, weight_decay=0.0)
    out: dict = {"names": _group_names(model, opt.param_groups),
                 "ref_names": _group_names(ref, ref_opt.param_groups),
                 "dims": [p.dim() for p in model.parameters()],
                 "ref_dims": [p.dim() for p in ref.parameters()], "losses": [], "ref_losses": [],
                 "diffs": []}
    for step in range(STEPS):
        x, y = batch(step, rank)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        gx, gy = global_batch(step, world)
        for net, o, losses in ((ref, ref_opt, out["ref_losses"]), (no_decay_ref, plain_opt, None)):
            ref_loss = F.cross_entropy(net(gx), gy)
            ref_loss.backward()
            o.step()
            o.zero_grad()
            if losses is not None:
                losses.append(ref_loss.item())
        out["losses"].append(loss.item())
        out["diffs"].append(max_diff(full_params(model), ref))
    # How far the run would be off if the rule had put every parameter in the no-decay group.
    out["decay_effect"] = max_diff({n: p.detach() for n, p in ref.named_parameters()}, no_decay_ref)
    return out


def newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Muon's quintic Newton-Schulz iteration: an approximately orthogonal matrix near g's polar factor."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g / (g.norm() + 1e-7)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


class MuonLike(torch.optim.Optimizer):
    """Momentum, then whole-matrix orthogonalised updates for 2-D parameters (Muon's step) and
    plain momentum steps for the rest. Written once for sharded and unsharded models: the
    matrix step goes through shardkit.full_tensor / local_shard, which pass plain tensors through."""

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure=None):
        """One step over every parameter; `closure` is accepted for torch's signature, unused."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad)
                if p.dim() == 2:
                    full = newton_schulz(shardkit.full_tensor(p, buf))
                    scale = max(1.0, full.shape[0] / full.shape[1]) ** 0.5
                    p.add_(shardkit.local_shard(p, full), alpha=-group["lr"] * scale)
                else:
                    p.add_(buf, alpha=-group["lr"])


def muon_run(rank: int, world: int, strategy: str = "FULL_SHARD", hybrid: int | None = None) -> dict:
    """MuonLike sharded vs unsharded; shapes, full_shape/full_tensor/local_shard checked on the way."""
    ref, model = _pair(strategy, hybrid)
    ref_shapes = {n: p.shape for n, p in ref.named_parameters()}
    group, shard_rank = get_state(model).shard_group.size, get_state(model).shard_group.rank
    out: dict = {
        "full_shape_ok": all(shardkit.full_shape(p) == ref_shapes[n]
                             for n, p in model.named_parameters()),
        # A parameter is a DTensor of the whole shape; its local tensor is torch.chunk's rows.
        "local_shape_ok": all(p.shape == ref_shapes[n] and p.to_local().shape == (
            torch.chunk(torch.empty(ref_shapes[n]), group)[shard_rank].shape
            if ref_shapes[n] and shard_rank < len(torch.chunk(torch.empty(ref_shapes[n]), group))
            else ((0, *ref_shapes[n][1:]) if ref_shapes[n] else ()))
            for n, p in model.named_parameters()),
        "plain_passthrough": all(shardkit.full_shape(p) == p.shape and shardkit.full_tensor(p)
                                 .data_ptr() == p.data_ptr() for p in ref.parameters()),
        "full_shape_sends": shardkit.comm_stats(model)["calls"].get("all_gather", 0),
        "diffs": [], "grad_diffs": []}
    out["roundtrip"] = all(torch.equal(shardkit.local_shard(p, shardkit.full_tensor(p)), p.detach())
                           for p in model.parameters())
    opt, ref_opt = MuonLike(model.parameters()), MuonLike(ref.parameters())
    for step in range(STEPS):
        x, y = batch(step, rank)
        F.cross_entropy(model(x), y).backward()
        gx, gy = global_batch(step, world)
        F.cross_entropy(ref(gx), gy).backward()
        refs = dict(ref.named_parameters())
        out["grad_diffs"].append(max((shardkit.full_tensor(p, p.grad) - refs[n].grad).abs().max()
                                     .item() for n, p in model.named_parameters()))
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        out["diffs"].append(max_diff(full_params(model), ref))
    p = model.get_parameter("head.weight")
    for name, call in [("full_tensor", lambda: shardkit.full_tensor(p, torch.zeros(3))),
                       ("local_shard", lambda: shardkit.local_shard(p, torch.zeros(3)))]:
        try:
            call()
            out[name] = None
        except shardkit.ShardkitError as exc:
            out[name] = str(exc)
    return out


def legacy_checkpoint_run(rank: int, world: int, strategy: str = "FULL_SHARD") -> dict:
    """Load the checkpoint written with 1-D shards; gather what was loaded; take one more AdamW
    step sharded and, from the fixture's full values, unsharded."""
    torch.manual_seed(3)  # other weights until loaded
    model = shardkit.shard(TinyNet(), strategy=strategy,
                           auto_wrap_policy=shardkit.wrap.transformer_layers({Block}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    extra = shardkit.checkpoint.load(os.path.join(FIXTURE, "ckpt"), model, opt)
    loaded_params = full_params(model)
    loaded_optim = local_optim(model, opt)
    state_shapes_ok = all(v.shape == p.shape for p in model.parameters()
                          for k, v in opt.state[p].items() if k != "step")
    expected = torch.load(os.path.join(FIXTURE, "expected.pt"), weights_only=True)
    ref = TinyNet()
    ref.load_state_dict(expected["params"])
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for name, p in ref.named_parameters():
        ref_opt.state[p] = {"step": torch.tensor(expected["steps"][name]),
                            **{key: expected["optim"][(name, key)].view(p.shape).clone()
                               for key in ("exp_avg", "exp_avg_sq")}}
    x, y = batch(2, rank)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    gx, gy = global_batch(2, world)
    F.cross_entropy(ref(gx), gy).backward()
    ref_opt.step()
    return {"extra": extra, "params": loaded_params, "optim": loaded_optim,
            "state_shapes_ok": state_shapes_ok, "after_step": max_diff(full_params(model), ref)}


def expected_legacy() -> dict:
    """The fixture's full values (what the 1-D-shard code gathered when it saved)."""
    return torch.load(os.path.join(FIXTURE, "expected.pt"), weights_only=True)


__all__ = ["assemble_optim", "decay_rule_run", "expected_legacy", "legacy_checkpoint_run",
           "muon_run"]
