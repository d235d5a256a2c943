"""Per-rank programs for test_torch_idioms.py: torch's own utilities called on a sharded model."""

from __future__ import annotations

import copy
import os
import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.utils import clip_grad_norm_ as clip_imported_early  # bound before any shard()

import shardkit
from shardkit.errors import ShardedStateDictWarning, ShardkitError
from shardkit.sharding.surface.torch_norms import _ORIGINAL_TOTAL_NORM
from shardkit.sharding.step.whole_view import local_of
from torch.distributed.tensor import DTensor

from _models import Block, TinyNet, batch, global_batch
from _sharding_workers import full_params, max_diff

STEPS = 20
CLIP = 0.05  # below every step's norm on this model: the clip is active at each step


def _clip_attr(params: list, clip: float, norm_type: float) -> torch.Tensor:
    return torch.nn.utils.clip_grad_norm_(params, clip, norm_type)


def _clip_early(params: list, clip: float, norm_type: float) -> torch.Tensor:
    return clip_imported_early(params, clip, norm_type)


def _clip_two_calls(params: list, clip: float, norm_type: float) -> torch.Tensor:
    total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None],
                                          norm_type)
    torch.nn.utils.clip_grads_with_norm_(params, clip, total)
    return total


def _clip_value(params: list, clip: float, norm_type: float) -> torch.Tensor:
    torch.nn.utils.clip_grad_value_(params, 0.01)  # elementwise: a shard's rows clip alone
    return torch.zeros(())


CLIPPERS: dict[str, Callable] = {"clip_grad_norm_": _clip_attr, "imported_early": _clip_early,
                                 "get_total_norm": _clip_two_calls, "clip_grad_value_": _clip_value}


def _pair(strategy: str, hybrid: int | None, **kwargs) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    ref = TinyNet()
    model = shardkit.shard(copy.deepcopy(ref), strategy=strategy, hybrid_group_size=hybrid,
                           auto_wrap_policy=shardkit.wrap.transformer_layers({Block}), **kwargs)
    return ref, model


def clip_run(rank: int, world: int, how: str, norm_type: float, strategy: str = "FULL_SHARD",
             hybrid: int | None = None, shard_kwargs: dict | None = None) -> dict:
    """20 AdamW steps clipped with a torch idiom, sharded vs the unsharded model on the global batch."""
    clipper = CLIPPERS[how]
    ref, model = _pair(strategy, hybrid, **(shard_kwargs or {}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    out: dict = {"norms": [], "ref_norms": [], "losses": [], "ref_losses": []}
    # An EMA of the weights kept the usual way, one tensor per parameter: on a sharded model
    # each average is a DTensor laid out like its parameter; full_tensor() is the whole one.
    ema = {p: p.detach().clone() for p in model.parameters()}
    ref_ema = {p: p.detach().clone() for p in ref.parameters()}
    for step in range(STEPS):
        x, y = batch(step, rank)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if step == 0:  # what torch's own function makes of this rank's rows alone
            grads = [(p, p.grad) for p in model.parameters() if p.grad is not None]
            out["rows_norm"] = float(_ORIGINAL_TOTAL_NORM([local_of(g) for _, g in grads],
                                                          norm_type))
            # ... and of the whole gradients, gathered: an independent answer for this model
            out["gathered_norm"] = float(_ORIGINAL_TOTAL_NORM(
                [shardkit.full_tensor(p, g) for p, g in grads], norm_type))
        out["norms"].append(float(clipper(list(model.parameters()), CLIP, norm_type)))
        opt.step()
        opt.zero_grad()
        gx, gy = global_batch(step, world)
        ref_loss = F.cross_entropy(ref(gx), gy)
        ref_loss.backward()
        out["ref_norms"].append(float(clipper(list(ref.parameters()), CLIP, norm_type)))
        ref_opt.step()
        ref_opt.zero_grad()
        out["losses"].append(loss.item())
        out["ref_losses"].append(ref_loss.item())
        with torch.no_grad():
            for averages in (ema, ref_ema):
                for p, avg in averages.items():
                    avg.mul_(0.9).add_(p.detach(), alpha=0.1)
    out["ema_diff"] = max((whole(ema[p]) - ref_ema[q]).abs().max().item()
                          for p, q in zip(model.parameters(), ref.parameters()))
    out["counts"] = (sum(p.numel() for p in model.parameters()),
                     sum(p.numel() for p in ref.parameters()),
                     sum(shardkit.full_shape(p).numel() for p in model.parameters()))
    out["shapes_whole"] = [p.shape for p in model.parameters()] == [p.shape for p in ref.parameters()]
    out["param_diff"] = max_diff(full_params(model), ref)
    out["grad_norm_log"] = _grad_norm_log(model, ref, rank, world, out)
    return out


def whole(value: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a value computed from sharded parameters, as FSDP2 users write it."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def _grad_norm_log(model: torch.nn.Module, ref: torch.nn.Module, rank: int, world: int,
                   out: dict) -> float:
    """Per-parameter gradient norms as a logger computes them: p.grad.norm(), made whole."""
    x, y = batch(99, rank)
    F.cross_entropy(model(x), y).backward()
    gx, gy = global_batch(99, world)
    F.cross_entropy(ref(gx), gy).backward()
    first = next(model.parameters())
    try:  # the bare idiom: this rank's part, refused rather than returned
        out["bare_item"] = first.grad.norm().item()
    except ShardkitError as exc:
        out["bare_item"] = str(exc)
    ours = {n: whole(p.grad.norm()).item() for n, p in model.named_parameters()}
    try:
        vector = torch.nn.utils.parameters_to_vector(p.grad for p in model.parameters())
        ref_vector = torch.nn.utils.parameters_to_vector(p.grad for p in ref.parameters())
        out["to_vector"] = (whole(vector) - ref_vector).abs().max().item()
    except RuntimeError as exc:  # torch's own refusal for rows that do not divide evenly
        out["to_vector"] = str(exc)
    return max(abs(ours[n] - p.grad.norm().item()) for n, p in ref.named_parameters())


def lifecycle_run(rank: int, world: int) -> dict:
    """torch's total-norm function is shardkit's while a job runs and torch's again after shutdown()."""
    import torch.nn.utils.clip_grad as clip_module

    original = clip_module._get_total_norm
    vendor_calls = []

    def vendor_clip(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        # A vendor's own clip_grad_norm_ (as torch_xla installs): never reaches _get_total_norm.
        vendor_calls.append(1)
        params = list(parameters)
        return torch.stack([p.grad.norm(norm_type) for p in params]).norm(norm_type)

    torch.nn.utils.clip_grad_norm_ = vendor_clip
    ref, model = _pair("FULL_SHARD", None)
    patched = clip_module._get_total_norm
    x, y = batch(0, rank)
    F.cross_entropy(model(x), y).backward()
    gx, gy = global_batch(0, world)
    F.cross_entropy(ref(gx), gy).backward()
    whole = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
    expected = float(clip_module.clip_grad_norm_(ref.parameters(), 1e9))
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)  # no shards: the vendor's
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type=-1.0)
        negative = ""
    except ShardkitError as exc:
        negative = str(exc)
    # A plain tensor's norm is torch's own, bit for bit, while the replacement is in place.
    plain = [torch.randn(7, 3, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    same = bool(torch.equal(torch.nn.utils.get_total_norm(plain), original(plain)))
    del model
    shardkit.shutdown()
    return {"vendor_whole": abs(whole - expected) <= 1e-5 * expected, "vendor_calls": len(vendor_calls),
            "vendor_restored": torch.nn.utils.clip_grad_norm_ is vendor_clip,
            "replaced": patched is not original, "restored": clip_module._get_total_norm is original,
            "public_restored": torch.nn.utils.get_total_norm is original,
            "negative": negative, "plain_same": same}


def state_dict_run(rank: int, world: int, tmp: str) -> dict:
    """state_dict()/load_state_dict() idioms against the unsharded model."""
    ref, model = _pair("FULL_SHARD", None)
    out: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sd = model.state_dict()
        model.state_dict()  # each call warns (the default filter: once per calling line)
    out["warnings"] = [str(w.message) for w in caught if w.category is ShardedStateDictWarning]
    # torch's own state-dict functions and shardkit's full_state_dict take the whole model: quiet
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        get_model_state_dict(model)
        get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        shardkit.checkpoint.full_state_dict(model)
    out["quiet_routes_warned"] = [str(w.message) for w in caught
                                  if w.category is ShardedStateDictWarning]
    torch.save(sd, os.path.join(tmp, f"rows-{rank}.pt"))
    # The DDP habit's file (rank 0's rows) loaded on every rank of a sharded model: refused
    # except on rank 0, which wrote it.
    shardkit.checkpoint.full_state_dict(model)  # a collective: every rank's file is written
    rank0 = torch.load(os.path.join(tmp, "rows-0.pt"))
    try:
        model.load_state_dict(rank0)
        out["rank0_rows"] = "loaded"
    except ShardkitError as exc:
        out["rank0_rows"] = str(exc)
    # This rank's own rows round-trip through torch.save / torch.load.
    mine = torch.load(os.path.join(tmp, f"rows-{rank}.pt"))
    fresh_ref, fresh = _pair("FULL_SHARD", None)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh.load_state_dict(mine)
    out["own_rows_diff"] = max_diff(full_params(fresh), ref)
    # The same file into an unsharded model: refused by torch (a DTensor is no plain tensor).
    try:
        TinyNet().load_state_dict(mine)
        out["into_unsharded"] = "loaded"
    except RuntimeError as exc:
        out["into_unsharded"] = str(exc)
    # A full (unsharded) state dict, as torch.save(ref.state_dict()) writes it, loads into the
    # sharded model; so does the whole-model dict shardkit gathers.
    full = shardkit.checkpoint.full_state_dict(model, rank0_only=False)
    torch.save(full, os.path.join(tmp, f"full-{rank}.pt"))
    for source, name in ((ref.state_dict(), "torch_full"),
                         (torch.load(os.path.join(tmp, f"full-{rank}.pt")), "gathered_full")):
        _, target = _pair("FULL_SHARD", None)
        with torch.no_grad():
            for p in target.parameters():
                p.zero_()
        result = target.load_state_dict(source)
        out[name] = (max_diff(full_params(target), ref), list(result.missing_keys),
                     list(result.unexpected_keys))
    bad = {k: v[:1] if v.dim() else v for k, v in ref.state_dict().items()}
    try:
        model.load_state_dict(bad)
        out["bad_shape"] = "loaded"
    except ShardkitError as exc:
        out["bad_shape"] = str(exc)
    try:
        model.load_state_dict(ref.state_dict(), assign=True)
        out["assign"] = "loaded"
    except ShardkitError as exc:
        out["assign"] = str(exc)
    return out


def other_world_run(rank: int, world: int, tmp: str) -> dict:
    """Files written by state_dict_run at another world size: the full dict loads, rows are refused."""
    ref, model = _pair("FULL_SHARD", None)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.load_state_dict(torch.load(os.path.join(tmp, "full-0.pt")))
    out = {"full_diff": max_diff(full_params(model), ref)}
    try:
        model.load_state_dict(torch.load(os.path.join(tmp, f"rows-{min(rank, 1)}.pt")))
        out["rows"] = "loaded"
    except ShardkitError as exc:
        out["rows"] = str(exc)
    return out


def conversion_run(rank: int, world: int) -> dict:
    """model.to(dtype)/.half()/.cpu()-style conversions after shard(): refused, nothing changed."""
    ref, model = _pair("FULL_SHARD", None)
    out: dict = {}
    for name, convert in (("to_bf16", lambda m: m.to(torch.bfloat16)), ("half", lambda m: m.half()),
                          ("double", lambda m: m.double()), ("meta", lambda m: m.to("meta"))):
        try:
            convert(model)
            out[name] = "converted"
        except ShardkitError as exc:
            out[name] = str(exc)
    model.to("cpu")  # changes nothing: allowed
    model.share_memory()
    out["dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    x, y = batch(0, rank)
    F.cross_entropy(model(x), y).backward()
    gx, gy = global_batch(0, world)
    F.cross_entropy(ref(gx), gy).backward()
    out["grad_diff"] = max((shardkit.full_tensor(p, p.grad) - q.grad).abs().max().item()
                           for p, q in zip(model.parameters(), ref.parameters()))
    return out
