"""Per-rank worker functions for the sharding tests (module-level so shardkit.spawn can pickle them)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools

import torch
import torch.nn.functional as F

import shardkit
from shardkit import Capabilities
from shardkit.sharding import iter_unit_full_params
from shardkit_backends.cpu import CPUBackend

from _models import Block, TinyNet, batch, global_batch

STEPS = 5


def full_params(model) -> dict[str, torch.Tensor]:
    """Gather every parameter of a sharded model (collective), keyed by original name."""
    out: dict[str, torch.Tensor] = {}
    for _, tensors in iter_unit_full_params(model):
        out.update({k: v.clone() for k, v in tensors.items()})
    return out


def shards_exposed(model: torch.nn.Module) -> bool:
    """True when every parameter the model exposes is its sharded (optimizer) parameter object."""
    shards = {id(sp.sharded) for sp in shardkit.sharding.get_state(model).iter_params()}
    return all(id(p) in shards for p in model.parameters())


def max_diff(full: dict[str, torch.Tensor], ref: torch.nn.Module) -> float:
    """Largest absolute difference between gathered params and a reference model's params."""
    return max((full[k].float() - p.detach().float()).abs().max().item()
               for k, p in ref.named_parameters())


def _build(seed: int, meta: bool, freeze: tuple[str, ...], tie: bool,
           model_cls: type) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(reference model, model to shard): equal values, same frozen/tied structure."""
    dev = shardkit.current_context().device
    with torch.device(dev):  # eager init on the device the meta model is materialised on (its RNG)
        torch.manual_seed(seed)
        ref = model_cls()
    if meta:
        with torch.device("meta"):
            torch.manual_seed(seed)
            model = model_cls()
    for name in freeze:
        ref.get_parameter(name).requires_grad_(False)
    if tie:
        ref.blocks[1].proj.weight = ref.blocks[0].proj.weight
    if not meta:
        model = copy.deepcopy(ref)  # keeps ties
    else:
        for name in freeze:
            model.get_parameter(name).requires_grad_(False)
        if tie:
            model.blocks[1].proj.weight = model.blocks[0].proj.weight
    return ref, model


def make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    """AdamW, or SGD with momentum 0.9 ("sgd")."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return torch.optim.AdamW(params, lr=lr)


def parity_run(rank: int, strategy: str, world: int, shard_kwargs: dict | None = None, *,
               seed: int = 0, lr: float = 1e-2, micro: int = 1, clip: float | None = None,
               norm_type: float = 2.0,
               freeze: tuple[str, ...] = (), tie: bool = False, meta: bool = False,
               two_forwards: bool = False, model_cls: type = TinyNet,
               eval_between: bool = False, sync_flag: bool = False, setup=None,
               optimizer: str = "adamw") -> dict:
    """Train sharded and unsharded (on the global batch) side by side; report per-step differences.

    micro > 1: the first micro-1 backward passes run under no_sync (sync_flag: under
    set_requires_gradient_sync(False) instead); the reference accumulates the same micro-batches.
    two_forwards: two forward passes, one backward of the summed loss. setup(model) runs once
    on the sharded model before training. optimizer: "adamw", or "sgd" (momentum 0.9), whose
    step does not divide by the gradient's magnitude and so keeps rounding differences small.
    """
    ref, model = _build(seed, meta, freeze, tie, model_cls)
    dev = shardkit.current_context().device
    ref.to(dev)
    model = shardkit.shard(model, strategy=strategy,
                           auto_wrap_policy=shardkit.wrap.transformer_layers({Block}),
                           **(shard_kwargs or {}))
    if setup is not None:
        setup(model)
    out: dict = {"init_diff": max_diff(full_params(model), ref), "diffs": [], "norms": [],
                 "frozen_grads": [], "devices": sorted({str(p.device) for p in model.parameters()})}
    opt = make_optimizer(optimizer, model.parameters(), lr)
    ref_opt = make_optimizer(optimizer, [p for p in ref.parameters() if p.requires_grad], lr)
    for step in range(STEPS):
        for j in range(micro):
            sync = j == micro - 1
            idx = step * micro + j
            if sync_flag:
                model.set_requires_gradient_sync(sync)
            with (model.no_sync() if not sync and not sync_flag else contextlib.nullcontext()):
                x, y = (t.to(dev) for t in batch(idx, rank))
                loss = F.cross_entropy(model(x), y)
                if two_forwards:
                    x2, y2 = (t.to(dev) for t in batch(idx + 500, rank))
                    loss = loss + F.cross_entropy(model(x2), y2)
                loss.backward()
            gx, gy = (t.to(dev) for t in global_batch(idx, world))
            ref_loss = F.cross_entropy(ref(gx), gy)
            if two_forwards:
                gx2, gy2 = (t.to(dev) for t in global_batch(idx + 500, world))
                ref_loss = ref_loss + F.cross_entropy(ref(gx2), gy2)
            ref_loss.backward()
        if clip is not None:
            ours = shardkit.clip_grad_norm_(model, clip, norm_type)
            theirs = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip, norm_type)
            out["norms"].append((float(ours), float(theirs)))
        out["frozen_grads"].append(sum(p.grad is not None for p in model.parameters()
                                       if not p.requires_grad))
        if eval_between:  # a no-grad forward before the step; the next forward must not reuse it
            with torch.no_grad():
                ex = batch(999, rank)[0].to(dev)
                out.setdefault("eval_diffs", []).append((model(ex) - ref(ex)).abs().max().item())
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        stats = shardkit.comm_stats(model, reset=True)  # before full_params adds its gathers
        out["rs_calls"] = out.get("rs_calls", 0) + stats["calls"].get("reduce_scatter", 0)
        out["ar_calls"] = out.get("ar_calls", 0) + stats["calls"].get("all_reduce", 0)
        out["peak_in_flight"] = max(out.get("peak_in_flight", 0), stats["peak_prefetch_in_flight"])
        out["diffs"].append(max_diff(full_params(model), ref))
        shardkit.comm_stats(model, reset=True)
    return out


def api_checks(rank: int, world: int) -> dict:
    """Names, shapes, views contract and load_full_param_ of a sharded TinyNet, as plain data."""
    from shardkit.sharding import load_full_param_, shard_views, sharding_info

    torch.manual_seed(0)
    ref = TinyNet()
    names = [n for n, _ in ref.named_parameters()]
    keys = list(ref.state_dict())
    model = shardkit.shard(copy.deepcopy(ref), auto_wrap_policy=shardkit.wrap.transformer_layers({Block}))
    out: dict = {"names_same": [n for n, _ in model.named_parameters()] == names,
                 "keys_same": list(model.state_dict()) == keys,
                 "dims_kept": [(p.dim(), p.shape[1:]) for p in model.parameters()] ==
                              [(p.dim(), p.shape[1:]) for p in ref.parameters()],
                 "info": sharding_info(model), "views": []}
    for v in shard_views(model):
        full = dict(ref.named_parameters())[v.fqn].detach().reshape(-1)
        mine = v.local.reshape(-1)  # the contract: flat offsets into the full tensor
        out["views"].append({
            "fqn": v.fqn, "numel": full.numel(), "shape": tuple(v.full_shape),
            "local_shape": tuple(v.local.shape), "shard_numel": v.shard_numel, "offset": v.offset,
            "valid": v.valid_numel, "shape_ok": v.full_shape == dict(ref.named_parameters())[v.fqn].shape,
            "slice_ok": torch.equal(mine[:v.valid_numel], full[v.offset:v.offset + v.valid_numel]),
            "pad_zero": bool((mine[v.valid_numel:] == 0).all()),
            "is_param": any(v.param is p for p in model.parameters()),
            "group": (v.shard_group.size, v.replica_group is None), "dtype": v.dtype})
    # load_full_param_: write a new full tensor, read it back through a gather.
    target = torch.arange(ref.head.weight.numel(), dtype=torch.float32).reshape(ref.head.weight.shape)
    before = model.get_parameter("head.weight")
    load_full_param_(model, "head.weight", target)
    out["load_same_object"] = model.get_parameter("head.weight") is before
    out["load_roundtrip"] = torch.equal(full_params(model)["head.weight"], target)
    out["errors"] = {}
    for name, call in [
            ("twice", lambda: shardkit.shard(model)),
            ("hybrid_k", lambda: shardkit.shard(TinyNet(), strategy="HYBRID_SHARD", hybrid_group_size=2)),
            ("strategy", lambda: shardkit.shard(TinyNet(), strategy="zero4")),
            ("device", lambda: shardkit.shard(TinyNet(), device_id="meta:0")),
            ("prefetch", lambda: shardkit.shard(TinyNet(), prefetch=-1))]:
        try:
            call()
            out["errors"][name] = None
        except shardkit.ShardkitError as exc:
            out["errors"][name] = str(exc)
    out["device_int"] = str(shardkit.sharding.get_state(shardkit.shard(TinyNet(), device_id=0)).device)
    # unshard(writeback=True) writes edits of the full weights back into the shards.
    with torch.no_grad(), model.unshard(writeback=True):
        model.head.bias.fill_(7.0)
    out["writeback"] = bool((full_params(model)["head.bias"] == 7.0).all())
    return out


def mp_parity_run(rank: int, world: int, strategy: str = "FULL_SHARD",
                  shard_kwargs: dict | None = None) -> list[float]:
    """bf16 compute + fp32 reduce vs a reference doing the same casts: per-rank bf16 replicas
    of the fp32 master, bf16 grads cast to fp32, summed in rank order and divided by world."""
    torch.manual_seed(0)
    dev = shardkit.current_context().device
    ref = TinyNet().to(dev)
    mp = shardkit.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = shardkit.shard(copy.deepcopy(ref), strategy=strategy, mixed_precision=mp,
                           auto_wrap_policy=shardkit.wrap.transformer_layers({Block}),
                           **(shard_kwargs or {}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    diffs = []
    for step in range(STEPS):
        x, y = (t.to(dev) for t in batch(step, rank))
        logits = model(x)
        assert logits.dtype == torch.bfloat16
        F.cross_entropy(logits, y).backward()
        opt.step()
        opt.zero_grad()
        mp_reference_grads(ref, step, world)
        ref_opt.step()
        ref_opt.zero_grad()
        diffs.append(max_diff(full_params(model), ref))
    return diffs


def mp_reference_grads(ref: torch.nn.Module, step: int, world: int,
                       output_dtype: torch.dtype | None = None) -> list[float]:
    """Set ref's grads to the mean of per-rank bf16 replicas' grads (cast to fp32, summed in rank
    order); the logits are cast to `output_dtype` before the loss. Returns each rank's loss."""
    dev = shardkit.current_context().device
    grads, losses = None, []
    for r in range(world):
        replica = copy.deepcopy(ref).to(torch.bfloat16)
        xr, yr = (t.to(dev) for t in batch(step, r))
        logits = replica(xr.to(torch.bfloat16))
        loss = F.cross_entropy(logits if output_dtype is None else logits.to(output_dtype), yr)
        loss.backward()
        losses.append(loss.item())
        g = [p.grad.float() for p in replica.parameters()]
        grads = g if grads is None else [a + b for a, b in zip(grads, g)]
    assert grads is not None
    for p, g in zip(ref.parameters(), grads):
        p.grad = g / world
    return losses


def unshard_checks(rank: int, world: int) -> dict:
    """model.unshard(): full weights once, forward without extra gathers, shards restored after."""
    torch.manual_seed(0)
    ref = TinyNet()
    model = shardkit.shard(copy.deepcopy(ref), auto_wrap_policy=shardkit.wrap.transformer_layers({Block}))
    x, _ = batch(0, rank)
    shardkit.comm_stats(model, reset=True)
    with torch.no_grad(), model.unshard():
        shapes_full = all(p.shape == q.shape for p, q in zip(model.parameters(), ref.parameters()))
        y = model(x)
        y2 = model(x)
    calls = shardkit.comm_stats(model)["calls"].get("all_gather", 0)
    return {"shapes_full": shapes_full, "out_diff": (y - ref(x)).abs().max().item(),
            "repeat_equal": torch.equal(y, y2), "gather_calls": calls,
            "units": len(model._shardkit_state.units),
            "sharded_after": shards_exposed(model)}


def features(rank: int, world: int) -> dict:
    """Many engine features on one set of ranks (each spawn costs seconds; share it)."""
    from _models import TwiceNet

    frozen_front = ("conv.weight", "conv.bias", "embed.weight", "embed.bias")
    return {
        "no_sync": parity_run(rank, "FULL_SHARD", world, micro=3),
        "no_sync_sgo": parity_run(rank, "SHARD_GRAD_OP", world, micro=2),
        "frozen": parity_run(rank, "FULL_SHARD", world,
                             freeze=("blocks.0.fc1.weight", "blocks.0.fc1.bias", "head.bias")),
        "inputs_no_grad": parity_run(rank, "FULL_SHARD", world, freeze=frozen_front),
        "tied": parity_run(rank, "FULL_SHARD", world, tie=True),
        "meta": parity_run(rank, "FULL_SHARD", world, meta=True),
        "two_forwards": parity_run(rank, "FULL_SHARD", world, two_forwards=True),
        "called_twice": parity_run(rank, "FULL_SHARD", world, model_cls=TwiceNet),
        "cpu_offload": parity_run(rank, "FULL_SHARD", world, {"cpu_offload": True}),
        "prefetch0": parity_run(rank, "FULL_SHARD", world, {"prefetch": 0}),
        "eval_full": parity_run(rank, "FULL_SHARD", world, eval_between=True),
        "eval_sgo": parity_run(rank, "SHARD_GRAD_OP", world, eval_between=True),
        "prefetch2": parity_run(rank, "FULL_SHARD", world, {"prefetch": 2}),
        "mixed_precision": mp_parity_run(rank, world),
        "unshard": unshard_checks(rank, world),
        "frozen_bytes": bytes_one_step(rank, world, "FULL_SHARD",
                                       freeze=("blocks.0.fc1.weight", "blocks.0.fc1.bias")),
    }


def fsdp2_compare(rank: int, world: int) -> dict:
    """Same model, data and AdamW under shardkit FULL_SHARD and torch's own FSDP2 (fully_shard).

    FSDP2 on gloo once summed instead of averaging (pytorch#162338); the grad ratio to the
    reference is measured rather than assumed, and FSDP2's grads are divided by it.
    """
    from torch.distributed.fsdp import fully_shard
    from shardkit.sharding import shard_views

    torch.manual_seed(0)
    ref = TinyNet()
    theirs = copy.deepcopy(ref)
    for block in theirs.blocks:
        fully_shard(block)
    fully_shard(theirs)
    ours = shardkit.shard(copy.deepcopy(ref), auto_wrap_policy=shardkit.wrap.transformer_layers({Block}))
    opt_t = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    opt_o = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    out: dict = {"grad_diffs": [], "param_diffs": []}
    for step in range(STEPS):
        x, y = batch(step, rank)
        F.cross_entropy(theirs(x), y).backward()
        F.cross_entropy(ours(x), y).backward()
        full_t = {n: p.grad.full_tensor() for n, p in theirs.named_parameters()}
        if step == 0:
            gx, gy = global_batch(step, world)
            F.cross_entropy(ref(gx), gy).backward()
            g = ref.embed.weight.grad
            out["fsdp2_grad_ratio"] = (full_t["embed.weight"].norm() / g.norm()).item()
        factor = round(out["fsdp2_grad_ratio"])
        out["grad_diffs"].append(max(
            (v.as_rows(v.param.grad).reshape(-1)[:v.valid_numel]
             - full_t[v.fqn].reshape(-1)[v.offset:v.offset + v.valid_numel] / factor).abs().max().item()
            for v in shard_views(ours)))
        # Both shard along dim 0: this rank's rows are FSDP2's local tensor (plus padding rows).
        local_t = {n: p.grad.to_local() for n, p in theirs.named_parameters()}
        out.setdefault("local_rows_diffs", []).append(max(
            (p.grad.to_local() - local_t[n] / factor).abs().max().item()
            if local_t[n].numel() else 0.0 for n, p in ours.named_parameters()))
        out["local_dims_as_fsdp2"] = all(
            p.shape[1:] == local_t[n].shape[1:] and p.shape[0] >= local_t[n].shape[0]
            for n, p in ours.named_parameters())
        opt_t.step()
        opt_t.zero_grad()
        opt_o.step()
        opt_o.zero_grad()
        mine = full_params(ours)
        out["param_diffs"].append(max((mine[n] - p.full_tensor()).abs().max().item()
                                      for n, p in theirs.named_parameters()))
    return out


def bytes_one_step(rank: int, world: int, strategy: str, shard_kwargs: dict | None = None,
                   freeze: tuple[str, ...] = ()) -> dict:
    """Bytes this rank sent in one training step, with the numbers the formulas need."""
    from shardkit.sharding import shard_views

    torch.manual_seed(0)
    model = TinyNet()
    for name in freeze:
        model.get_parameter(name).requires_grad_(False)
    model = shardkit.shard(model, strategy=strategy,
                           auto_wrap_policy=shardkit.wrap.transformer_layers({Block}),
                           **(shard_kwargs or {}))
    views = shard_views(model)
    shardkit.comm_stats(model, reset=True)
    x, y = batch(0, rank)
    F.cross_entropy(model(x), y).backward()
    stats = shardkit.comm_stats(model, reset=True)
    n = views[0].shard_group.size
    from shardkit.sharding.surface.module_api import get_state

    return {"stats": stats, "P": sum(v.full_shape.numel() for v in views),
            # FULL_SHARD gathers the root once a step: it keeps its parameters for backward
            "padded_root": sum(sp.padded_numel for sp in get_state(model).root_unit.params),
            "padded": sum(v.shard_numel * n for v in views), "shard_group": n,
            "padded_trainable": sum(v.shard_numel * n for v in views if v.requires_grad),
            "replica_group": views[0].replica_group.size if views[0].replica_group else 1}


def clip_run(rank: int, world: int) -> dict:
    """clip_grad_norm_ (2-norm with clipping active, and inf-norm) against torch's on the reference."""
    return {"l2": parity_run(rank, "FULL_SHARD", world, clip=0.05),
            "inf": parity_run(rank, "FULL_SHARD", world, clip=0.01, norm_type=float("inf")),
            "hybrid_l2": (parity_run(rank, "HYBRID_SHARD", world, {"hybrid_group_size": 2}, clip=0.05)
                          if world == 4 else None)}


STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")


@contextlib.contextmanager
def swapped_capabilities(caps: Capabilities):
    """Make the running backend declare `caps` for the models built inside; saves a spawn: the
    engine reads only capabilities, so this is that backend's code path on gloo."""
    be = shardkit.current_context().backend
    be.capabilities = caps
    try:
        yield be
    finally:
        del be.capabilities  # back to the class's


def direct_collectives(numel: int | None):
    """The running backend with Capabilities.direct_collective_numel forced to `numel`."""
    caps = shardkit.current_context().backend.capabilities
    return swapped_capabilities(dataclasses.replace(caps, direct_collective_numel=numel))


def direct_buckets(model) -> int:
    """How many of the model's gather buckets are direct (one param, gathered into its storage)."""
    from shardkit.sharding import get_state

    return sum(b.direct for u in get_state(model).units for b in u.gather_buckets)


def _grads_reduced_in_place(rank: int, world: int) -> int:
    """How many gradients one FULL_SHARD step reduced as their own collective input (no packing)."""
    from shardkit.sharding.step import comms as unit_module  # where a unit's reduction starts

    real, used = unit_module.grad_as_input, []

    def spy(*args, **kwargs):
        inp = real(*args, **kwargs)
        used.append(inp is not None)
        return inp

    unit_module.grad_as_input = spy
    try:
        parity_run(rank, "FULL_SHARD", world)
    finally:
        unit_module.grad_as_input = real
    return sum(used) // STEPS


def _tiny_direct_buckets() -> int:
    return direct_buckets(shardkit.shard(
        TinyNet(), auto_wrap_policy=shardkit.wrap.transformer_layers({Block})))


def direct_parity(rank: int, world: int) -> dict:
    """The parity runs with every param in a direct bucket (forced on). Forced off is the plain
    parity suite: TinyNet has no param near the cpu backend's threshold (counted here)."""
    out: dict = {"default_direct_buckets": _tiny_direct_buckets()}
    with direct_collectives(None):
        out["off_direct_buckets"] = _tiny_direct_buckets()
    with direct_collectives(1):
        case = {s: parity_run(rank, s, world) for s in STRATEGIES}
        if world == 4:
            case["HYBRID_SHARD"] = parity_run(rank, "HYBRID_SHARD", world, {"hybrid_group_size": 2})
            case["reshard_2"] = parity_run(rank, "FULL_SHARD", world, {"reshard_after_forward": 2})
        if world == 2:
            case["no_sync"] = parity_run(rank, "FULL_SHARD", world, micro=2)
            case["prefetch2"] = parity_run(rank, "FULL_SHARD", world, {"prefetch": 2})
            case["cpu_offload"] = parity_run(rank, "FULL_SHARD", world, {"cpu_offload": True})
            case["tied"] = parity_run(rank, "FULL_SHARD", world, tie=True)
            case["mixed_precision"] = mp_parity_run(rank, world)
        out["on"] = case
        out["on_direct_buckets"] = _tiny_direct_buckets()
        out["on_grads_as_inputs"] = _grads_reduced_in_place(rank, world)
    if world == 2:  # no storage to resize (XLA-like): each gather lands in a fresh flat buffer
        lazy = dataclasses.replace(LazyLikeCPU.capabilities, direct_collective_numel=1)
        with swapped_capabilities(lazy):
            out["on"]["lazy_like"] = parity_run(rank, "FULL_SHARD", world)
            out["on"]["lazy_like_reshard_2"] = parity_run(rank, "FULL_SHARD", world,
                                                          {"reshard_after_forward": 2})
    return out


def suite(rank: int, world: int) -> dict:
    """Every multi-rank check that runs at this world size, in one spawn."""
    out: dict = {"parity": {s: parity_run(rank, s, world) for s in STRATEGIES},
                 "direct": direct_parity(rank, world)}
    if world == 2:
        out["features"] = features(rank, world)
        out["fsdp2"] = fsdp2_compare(rank, world)
    if world == 3:
        out["api"] = api_checks(rank, world)
        out["clip"] = clip_run(rank, world)
        out["bytes"] = {s: bytes_one_step(rank, world, s) for s in STRATEGIES}
    if world == 4:
        hybrid = {"hybrid_group_size": 2}
        out["parity"]["HYBRID_SHARD"] = parity_run(rank, "HYBRID_SHARD", world, hybrid)
        out["hybrid_no_sync"] = parity_run(rank, "HYBRID_SHARD", world, hybrid, micro=2)
        out["hybrid_info"] = __import__("shardkit.sharding", fromlist=["x"]).sharding_info(
            shardkit.shard(TinyNet(), strategy="HYBRID_SHARD", hybrid_group_size=2))
        out["clip"] = clip_run(rank, world)
        out["bytes"] = {"HYBRID_SHARD": bytes_one_step(rank, world, "HYBRID_SHARD", hybrid)}
    if world in (2, 4):
        from _knob_workers import knobs_suite  # imports this module: a top-level import would cycle

        out["knobs"] = knobs_suite(rank, world)
    return out


@functools.lru_cache(maxsize=None)
def spawn_suite(world: int) -> list[dict]:
    """Run `suite` on `world` ranks once per test session; test files share the result."""
    return shardkit.spawn(suite, world, world, threads_per_rank=1)


def gpu_suite(rank: int, world: int) -> dict:
    """One rank on an accelerator backend: streams, events and storage freeing on a real device."""
    out = {"device": str(shardkit.current_context().device),
           "parity": {s: parity_run(rank, s, world) for s in STRATEGIES}}
    for name, kwargs in [("no_sync", {"micro": 2}), ("meta", {"meta": True}),
                         ("tied", {"tie": True}), ("called_twice", {"model_cls": __import__(
                             "_models").TwiceNet})]:
        out[name] = parity_run(rank, "FULL_SHARD", world, **kwargs)
    out["prefetch2"] = parity_run(rank, "FULL_SHARD", world, {"prefetch": 2})
    out["cpu_offload"] = parity_run(rank, "FULL_SHARD", world, {"cpu_offload": True})
    out["mixed_precision"] = mp_parity_run(rank, world)
    return out


class LazyLikeCPU(CPUBackend):
    """gloo, declaring what a lazy-tensor device declares: no storage resize, no async
    collectives, compiler barriers, a shard alignment of 4 elements, and no torch process group
    to build a DeviceMesh on (so parameters stay plain padded rows, as on XLA)."""

    name = "cpu-lazy-like"
    capabilities = Capabilities(has_streams=False, async_collectives=False,
                                supports_storage_resize=False, shard_alignment=4,
                                needs_compiler_barrier=True, torch_process_group=False)
    barriers = 0

    def compiler_barrier(self, tensors):
        """Count calls; gloo itself needs none."""
        type(self).barriers += 1


def lazy_like_suite(rank: int, world: int) -> dict:
    """The no-storage-resize / barrier / alignment code paths, checked against the reference."""
    from shardkit.sharding import shard_views

    be = shardkit.current_context().backend
    out = {"backend": be.name,
           "parity": {s: parity_run(rank, s, world) for s in STRATEGIES},
           "no_sync": parity_run(rank, "FULL_SHARD", world, micro=2),
           "meta": parity_run(rank, "FULL_SHARD", world, meta=True),
           "unshard": unshard_checks(rank, world)}
    model = shardkit.shard(TinyNet())
    out["shard_sizes"] = [(tuple(v.full_shape), v.shard_numel) for v in shard_views(model)]
    out["barriers"] = type(be).barriers
    return out
