"""Per-rank workers for users' own collectives (model.set_custom_all_gather / _reduce_scatter).

The comms subclass torch's own FSDP2 interfaces (AllGather / ReduceScatter, which torch keeps in
torch.distributed.fsdp._fully_shard._fsdp_api), so the same objects run under torch's fully_shard in the same process.
"""

from __future__ import annotations

import gc
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

import shardkit
from shardkit.sharding.surface.module_api import get_state

from _models import Block, TinyNet, batch

STEPS = 3


class RecordingGather(AllGather):
    """torch's all-gather, noting each call: (output numel, input numel, dtype, async_op)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.allocated = 0

    def allocate(self, size, *, dtype, device):
        """A plain buffer, counted."""
        self.allocated += 1
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        """Note the call, then run torch's all-gather on the given process group."""
        self.calls.append((output_tensor.numel(), input_tensor.numel(), str(output_tensor.dtype),
                           bool(async_op)))
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return gather(output_tensor, input_tensor, group=group, async_op=async_op)


class RecordingScatter(ReduceScatter):
    """torch's reduce-scatter, noting each call: (output numel, input numel, dtype, op)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def allocate(self, size, *, dtype, device):
        """A plain buffer."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        """Note the call, then run torch's reduce-scatter on the given process group."""
        self.calls.append((output_tensor.numel(), input_tensor.numel(), str(output_tensor.dtype),
                           str(op)))
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def _shard(strategy: str, **kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    return shardkit.shard(TinyNet(), strategy=strategy,
                          auto_wrap_policy=shardkit.wrap.transformer_layers({Block}), **kwargs)


def _train(model: torch.nn.Module, rank: int, steps: int = STEPS, counted: bool = True) -> list[dict]:
    """AdamW steps on this rank's batches; each step's comm_stats (`counted`: a shardkit model)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stats = []
    for step in range(steps):
        x, y = batch(step, rank)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if counted:
            stats.append(shardkit.comm_stats(model, reset=True))
    return stats


def _spy(backend, name: str, calls: list, describe) -> None:
    """Note every call of the backend's own collective `name` on this instance."""
    original = getattr(backend, name)

    def spied(*args, **kwargs):
        calls.append(describe(*args, **kwargs))
        return original(*args, **kwargs)

    setattr(backend, name, spied)


def where_called(rank: int, world: int, strategy: str, extra: dict) -> dict:
    """The same steps with the built-in collectives (the backend's calls noted) and with the
    recording comms: calls, bytes and final weights side by side."""
    built_in = _shard(strategy, **extra)
    backend = get_state(built_in).backend
    gathers: list = []
    scatters: list = []
    _spy(backend, "all_gather_into_tensor", gathers,
         lambda out, inp, group, async_op=False: (out.numel(), inp.numel(), str(out.dtype),
                                                  bool(async_op)) if group.size > 1 else None)
    _spy(backend, "reduce_scatter_tensor", scatters,
         lambda out, inp, group, op="sum", async_op=False, **kw: (out.numel(), inp.numel(),
                                                                 str(out.dtype), op)
         if group.size > 1 else None)
    try:
        built_in_stats = _train(built_in, rank)
    finally:
        del backend.all_gather_into_tensor, backend.reduce_scatter_tensor  # the class's again
    custom = _shard(strategy, **extra)
    gather, scatter = RecordingGather(), RecordingScatter()
    custom.set_custom_all_gather(gather)
    custom.set_custom_reduce_scatter(scatter)
    custom_stats = _train(custom, rank)
    ours = {n: shardkit.full_tensor(p) for n, p in custom.named_parameters()}
    theirs = {n: shardkit.full_tensor(p) for n, p in built_in.named_parameters()}
    # Back to the built-in: the recording comms are no longer called.
    custom.set_custom_all_gather(None)
    custom.set_custom_reduce_scatter(None)
    before = (len(gather.calls), len(scatter.calls))
    _train(custom, rank, steps=1)
    after = (len(gather.calls), len(scatter.calls))
    gather_calls, scatter_calls = list(gather.calls), list(scatter.calls)
    comm_ref = weakref.ref(gather)
    del custom, gather, scatter
    gc.collect()
    return {"builtin_gathers": [c for c in gathers if c is not None],
            "builtin_scatters": [c for c in scatters if c is not None],
            "gather_calls": gather_calls, "scatter_calls": scatter_calls,
            "stats_equal": built_in_stats == custom_stats,
            "weights_equal": all(torch.equal(ours[n], theirs[n]) for n in ours),
            "called_after_none": after != before,
            "comm_freed": comm_ref() is None}


def parity(rank: int, world: int, strategy: str, extra: dict) -> dict:
    """parity_run (5 AdamW steps beside the unsharded model on the global batch) with the
    recording comms set before the first step."""
    from _sharding_workers import parity_run

    comms: dict = {}

    def setup(model):
        comms["gather"], comms["scatter"] = RecordingGather(), RecordingScatter()
        model.set_custom_all_gather(comms["gather"])
        model.set_custom_reduce_scatter(comms["scatter"])

    result = parity_run(rank, strategy, world, extra, setup=setup)
    return {"diffs": result["diffs"], "gathers": len(comms["gather"].calls),
            "scatters": len(comms["scatter"].calls)}


def beside_fsdp2(rank: int, world: int) -> dict:
    """The same recording comms under torch's fully_shard (one per Block, then the root) and
    under shardkit (a unit per Block, the root last): the calls of one training step."""
    from torch.distributed.fsdp import fully_shard

    out = {}
    torch.manual_seed(0)
    model = TinyNet()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    gather, scatter = RecordingGather(), RecordingScatter()
    for module in (*model.blocks, model):
        module.set_custom_all_gather(gather)
        module.set_custom_reduce_scatter(scatter)
    _train(model, rank, steps=2, counted=False)
    gather.calls.clear()
    scatter.calls.clear()
    _train(model, rank, steps=1, counted=False)
    # The async flag differs by design: on the host FSDP2 gathers synchronously, shardkit's
    # prefetches overlap (asked async_op=True).
    out["fsdp2"] = (sorted(c[:3] for c in gather.calls), sorted(c[:3] for c in scatter.calls))
    ours = _shard("FULL_SHARD")
    gather, scatter = RecordingGather(), RecordingScatter()
    ours.set_custom_all_gather(gather)
    ours.set_custom_reduce_scatter(scatter)
    _train(ours, rank, steps=2)
    gather.calls.clear()
    scatter.calls.clear()
    _train(ours, rank, steps=1)
    out["shardkit"] = (sorted(c[:3] for c in gather.calls), sorted(c[:3] for c in scatter.calls))
    return out


def refusals(rank: int, world: int) -> dict:
    """What each misuse of the setters says."""
    said = {}

    def attempt(name, call):
        try:
            call()
            said[name] = None
        except shardkit.ShardkitError as exc:
            said[name] = str(exc)

    model = _shard("FULL_SHARD")
    attempt("not_a_comm", lambda: model.set_custom_all_gather(lambda *a, **k: None))
    attempt("scatter_not_a_comm", lambda: model.set_custom_reduce_scatter(object()))
    quantized = _shard("FULL_SHARD", quantize=shardkit.Quantization(weights=True, gradients=True))
    attempt("quantized_gather", lambda: quantized.set_custom_all_gather(RecordingGather()))
    attempt("quantized_scatter", lambda: quantized.set_custom_reduce_scatter(RecordingScatter()))
    x, y = batch(0, rank)
    loss = F.cross_entropy(model(x), y)  # a backward is now due
    attempt("mid_step", lambda: model.set_custom_reduce_scatter(RecordingScatter()))
    loss.backward()
    attempt("between_steps", lambda: model.set_custom_reduce_scatter(RecordingScatter()))
    return said
