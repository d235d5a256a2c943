"""Per-rank workers for the failure tests: one rank dies or raises at a chosen place in a step."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time

import torch
import torch.nn.functional as F

import shardkit

from _models import Block, TinyNet, batch

FAIL_STEP = 2


def _attempt(out: dict, name: str, fn) -> None:
    """Call fn; record the ShardkitError text it raised under `name` (None if it raised none)."""
    try:
        fn()
        out[name] = None
    except shardkit.ShardkitError as exc:
        out[name] = f"{type(exc).__name__}: {exc}"


class InjectedFailure(Exception):
    """The exception a victim rank raises on purpose."""


def _fail(kind: str, mark: str) -> None:
    with open(mark, "w") as f:
        f.write(repr(time.time()))
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "dataloader":  # the words torch's DataLoader uses, raised far from any collective
        raise RuntimeError("DataLoader timed out after 5 seconds")
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


def disagreeing_models(rank: int, world: int) -> dict:
    """shard() on models that differ on the last rank in one way each; return each error text."""
    odd = rank == world - 1
    policy = shardkit.wrap.transformer_layers({Block})
    cases = {
        "shape": lambda: (TinyNet(dim=15 if odd else 14), policy),
        "dtype": lambda: (TinyNet().double() if odd else TinyNet(), policy),
        "name": lambda: (TinyNet(blocks=3 if odd else 2), policy),
        "wrap_plan": lambda: (TinyNet(), None if odd else policy),
        "frozen": lambda: (TinyNet().requires_grad_(not odd), policy),
    }
    out = {}
    for name, build in cases.items():
        model, wrap = build()
        try:
            shardkit.shard(model, auto_wrap_policy=wrap)
            out[name] = None
        except shardkit.ShardkitError as exc:
            out[name] = str(exc)
    # Agreeing ranks still shard (and train a step) after the refusals above.
    model = shardkit.shard(TinyNet(), auto_wrap_policy=policy)
    x, y = batch(0, rank)
    F.cross_entropy(model(x), y).backward()
    out["then_ok"] = all(p.grad is not None for p in model.parameters())
    return out


class _NotWeightsOnly:
    """An object torch.load(weights_only=True) refuses to rebuild."""


def _raise_oserror(code: int):
    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))
    return fail


def checkpoint_errors(rank: int, world: int, root: str) -> dict:
    """Save/load failures on a trained TinyNet; every error text plus whether the good checkpoint survived."""
    import errno
    from unittest import mock

    import torch.distributed.checkpoint.filesystem as dcp_fs

    ck = shardkit.checkpoint
    policy = shardkit.wrap.transformer_layers({Block})

    def make(**kw):
        torch.manual_seed(0)
        model = shardkit.shard(TinyNet(**kw), auto_wrap_policy=policy)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, opt = make()
    x, y = batch(0, rank)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    good = os.path.join(root, "ckpt")
    ck.save(good, model, opt, extra={"step": 1})
    saved = {k: v.clone() for k, v in ck.full_state_dict(model).items()}
    F.cross_entropy(model(x), y).backward()
    opt.step()  # the live model now differs from what `good` holds
    out: dict = {}
    attempt = functools.partial(_attempt, out)

    with mock.patch("os.makedirs", _raise_oserror(errno.EROFS)):
        attempt("read_only", lambda: ck.save(os.path.join(root, "ro", "ckpt"), model, opt))
    # The disk fills up while the last rank writes its shard file of a save over `good`.
    full = mock.patch.object(dcp_fs, "_write_item", _raise_oserror(errno.ENOSPC)) \
        if rank == world - 1 else contextlib.nullcontext()
    with full:
        attempt("disk_full", lambda: ck.save(good, model, opt, extra={"step": 2}))
    attempt("not_weights_only", lambda: ck.save(os.path.join(root, "x"), model,
                                                 extra={"step": 3, "obj": _NotWeightsOnly()}))
    out["x_exists"] = os.path.exists(os.path.join(root, "x"))
    # Not even picklable (a lambda): refused on every rank alike, so training and saving go on.
    attempt("unpicklable", lambda: ck.save(os.path.join(root, "y"), model,
                                            extra={"step": 3, "fn": lambda: 0}))
    F.cross_entropy(model(x), y).backward()
    opt.step()
    ck.save(os.path.join(root, "after"), model, opt, extra={"step": 3})
    out["saved_after_unpicklable"] = os.path.exists(os.path.join(root, "after"))
    attempt("missing_dir", lambda: ck.load(os.path.join(root, "never-saved"), model))
    for name, kw in (("shallower", {"blocks": 1}), ("deeper", {"blocks": 3}), ("wider", {"dim": 16})):
        other, _ = make(**kw)
        attempt(name, lambda other=other: ck.load(good, other))
    # The hint's strict=False: the shared entries load, the rest keep their values; shapes
    # must still agree, and the optimizer must be the one that saved.
    deeper, _ = make(blocks=3)
    kept = {k: v.clone() for k, v in ck.full_state_dict(deeper).items() if k.startswith("blocks.2.")}
    ck.load(good, deeper, strict=False)
    got = ck.full_state_dict(deeper)
    out["non_strict_loaded"] = all(torch.equal(got[k], saved[k]) for k in saved)
    # full_state_dict is rank 0's alone: there, all 11 entries of the new block kept their values.
    out["non_strict_kept"] = (all(torch.equal(got[k], kept[k]) for k in kept)
                              and len(kept) == (11 if rank == 0 else 0))
    wider, _ = make(dim=16)
    attempt("non_strict_wider", lambda: ck.load(good, wider, strict=False))
    sgd_model, _ = make()
    sgd = torch.optim.SGD(sgd_model.parameters(), lr=0.1, momentum=0.9)
    attempt("other_optimizer", lambda: ck.load(good, sgd_model, sgd))
    # The checkpoint from before the failed saves still loads, verifies and holds the step-1 state.
    fresh, fresh_opt = make()
    extra = ck.load(good, fresh, fresh_opt)
    loaded = ck.full_state_dict(fresh)
    out["previous_intact"] = (extra["step"] == 1 and loaded.keys() == saved.keys()
                              and all(torch.equal(loaded[k], saved[k]) for k in saved))
    return out


class _RawModule(torch.nn.Module):
    """A module with a parameter but no reset_parameters(), so shard() cannot initialise it from meta."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ w."""
        return x @ self.w


def misuse(rank: int, world: int) -> dict:
    """shard() and training misuse on every rank; each error text (None where nothing was raised)."""
    policy = shardkit.wrap.transformer_layers({Block})
    out: dict = {}
    attempt = functools.partial(_attempt, out)

    attempt("unknown_backend", lambda: shardkit.shard(TinyNet(), backend="nope"))
    attempt("backend_not_installed", lambda: shardkit.shard(TinyNet(), backend="xpu"))
    attempt("device_float", lambda: shardkit.shard(TinyNet(), device_id=0.5))
    attempt("device_other_type", lambda: shardkit.shard(TinyNet(), device_id="xpu:0"))
    attempt("device_out_of_range", lambda: shardkit.shard(TinyNet(), device_id="cpu:5"))
    attempt("device_int_out_of_range", lambda: shardkit.shard(TinyNet(), device_id=7))
    attempt("strategy_typo", lambda: shardkit.shard(TinyNet(), strategy="full_shrd"))
    attempt("strategy_type", lambda: shardkit.shard(TinyNet(), strategy=3))
    attempt("zero_params", lambda: shardkit.shard(torch.nn.Sequential(torch.nn.ReLU())))
    with torch.device("meta"):
        raw = _RawModule()
    attempt("meta_no_reset", lambda: shardkit.shard(raw))
    # A model torch's tensor parallelism already sharded (issue 51 composes them; until then: said).
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    tp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    parallelize_module(tp, init_device_mesh("cpu", (world,)), {"0": ColwiseParallel()})
    attempt("tensor_parallel_model", lambda: shardkit.shard(tp))
    # Valid spellings still work: a strategy as a lower-case string, the device as a string.
    ok = shardkit.shard(TinyNet(), strategy="shard_grad_op", device_id="cpu", auto_wrap_policy=policy)
    out["string_strategy"] = shardkit.sharding.sharding_info(ok)["strategy"]
    # An optimizer built before shard() holds the replaced full tensors: the first step says so.
    torch.manual_seed(0)
    net = TinyNet()
    early = torch.optim.SGD(net.parameters(), lr=0.1)
    model = shardkit.shard(net, auto_wrap_policy=policy)
    x, y = batch(0, rank)
    F.cross_entropy(model(x), y).backward()
    attempt("optimizer_before_shard", early.step)
    attempt("optimizer_before_shard_again", early.step)  # checked once; the first step raised
    late = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    attempt("optimizer_after_shard", late.step)
    out["late_trained"] = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    return out


def bad_inputs(rank: int, world: int, root: str) -> dict:
    """misuse() and checkpoint_errors() in one job (each job start costs seconds)."""
    return {"misuse": misuse(rank, world), "checkpoint": checkpoint_errors(rank, world, root)}


def finish_unevenly(rank: int, world: int, work_s: float) -> str:
    """One collective, then every rank but 0 works alone for `work_s` seconds before returning."""
    t = torch.ones(1)
    shardkit.current_context().backend.all_reduce(t, shardkit.current_context().world)
    if rank != 0:
        time.sleep(work_s)  # longer than the timeout: rank 0 and its store are long gone
    return f"rank {rank} done, sum {t.item():g}"


def watchdog_state(rank: int) -> dict:
    """Whether shardkit.spawn's init() started a watchdog (SHARDKIT_WATCHDOG decides) and
    replaced sys.excepthook, and whether shutdown() put the hook back."""
    import sys

    from shardkit import failure

    out = {"active": failure.active() is not None,
           "hook_replaced": sys.excepthook is failure._excepthook}
    shardkit.shutdown()
    out["hook_restored"] = sys.excepthook is not failure._excepthook
    return out



def finish_early(rank: int, world: int) -> str:
    """Rank 0 trains 2 steps and leaves (shutdown); the others expect 6 and meet an absent peer."""
    model = shardkit.shard(torch.nn.Linear(16, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2 if rank == 0 else 6):
        model(torch.ones(4, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.3)
    shardkit.shutdown()
    return "done"
