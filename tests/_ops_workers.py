"""Rank workers for tests/test_sharding_ops.py: output_dtype, cast_forward_inputs, forward methods
and the engine's exact-reduce-op path, all in one 2-rank spawn on a gloo backend that declares
AVG and PREMUL_SUM (implemented exactly, so the engine's use of them is what is tested)."""

from __future__ import annotations

import copy
import dataclasses
import tempfile
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

import shardkit
from shardkit.backend import check_reduce_op
from shardkit.handles import CompletedWork
from shardkit.testing.conformance import run_checks
from shardkit_backends.cpu import CPUBackend

from _models import Block, TinyNet, batch, global_batch
from _sharding_workers import (bytes_one_step, full_params, max_diff, mp_reference_grads,
                               parity_run, shards_exposed)

STEPS = 3


class ExactOpsCPU(CPUBackend):
    """gloo declaring AVG (gloo's own, which sums then divides) and PREMUL_SUM (the input scaled,
    then SUM); `enabled` is what it answers for exact_reduce_ops_for, switched per case."""

    name = "cpu-exact"
    capabilities = dataclasses.replace(CPUBackend.capabilities,
                                       exact_reduce_ops=frozenset({"avg", "premul_sum"}))
    enabled: ClassVar[frozenset[str]] = frozenset()
    calls: ClassVar[list[tuple[str, str, float | None]]] = []

    def exact_reduce_ops_for(self, dtype: torch.dtype) -> frozenset[str]:
        """The ops switched on for the running case."""
        return type(self).enabled

    def torch_reduce_op(self, op: str, factor: float | None = None) -> Any:
        """gloo has no PREMUL_SUM: the collectives below scale the input and sum."""
        if op == "premul_sum":
            check_reduce_op(self, op, factor)
            return torch.distributed.ReduceOp.SUM
        return super().torch_reduce_op(op, factor)

    def reduce_scatter_tensor(self, output, input, group, op="sum", async_op=False, *,
                              factor=None):
        """Record the op; PREMUL_SUM as a scaled copy summed synchronously."""
        type(self).calls.append(("reduce_scatter", op, factor))
        if op != "premul_sum" or group.size == 1:
            return super().reduce_scatter_tensor(output, input, group, op, async_op, factor=factor)
        super().reduce_scatter_tensor(output, input * factor, group, "sum").wait()
        return CompletedWork()

    def all_reduce(self, tensor, group, op="sum", async_op=False, *, factor=None):
        """Record the op; PREMUL_SUM scales in place, then sums."""
        type(self).calls.append(("all_reduce", op, factor))
        if op == "premul_sum" and group.size > 1:
            tensor.mul_(factor)
            op, factor = "sum", None
        return super().all_reduce(tensor, group, op, async_op, factor=factor)


def _count_divides(fn) -> int:
    """How many Tensor.div_ calls `fn` makes from Python (the engine's divide is one)."""
    original = torch.Tensor.div_
    count = [0]

    def spy(self, *args, **kwargs):
        count[0] += 1
        return original(self, *args, **kwargs)

    torch.Tensor.div_ = spy  # type: ignore[method-assign]
    try:
        fn()
    finally:
        torch.Tensor.div_ = original  # type: ignore[method-assign]
    return count[0]


def _one_backward(rank: int, strategy: str) -> int:
    torch.manual_seed(0)
    model = shardkit.shard(TinyNet(), strategy=strategy,
                           auto_wrap_policy=shardkit.wrap.transformer_layers({Block}))
    x, y = batch(0, rank)
    return _count_divides(lambda: F.cross_entropy(model(x), y).backward())


def exact_ops(rank: int, world: int) -> dict:
    """The engine on AVG, on PREMUL_SUM and on SUM + divide: parity, ops issued, divides, bytes."""
    be = ExactOpsCPU
    out: dict = {}
    for label, enabled in (("avg", {"avg"}), ("premul_sum", {"premul_sum"}), ("sum", set())):
        be.enabled = frozenset(enabled)
        case: dict = {}
        for strategy in ("FULL_SHARD", "NO_SHARD"):
            be.calls.clear()
            case[strategy] = parity_run(rank, strategy, world)
            case[f"{strategy}_calls"] = sorted(set(be.calls))
            case[f"{strategy}_divides"] = _one_backward(rank, strategy)
        case["bytes"] = bytes_one_step(rank, world, "FULL_SHARD")["stats"]
        out[label] = case
    be.enabled = frozenset({"avg", "premul_sum"})
    with tempfile.TemporaryDirectory() as workdir:
        out["conformance"] = run_checks(rank, ["exact_reduce_ops"], workdir, world)
    be.enabled = frozenset()
    return out


# ---- MixedPrecision.output_dtype / cast_forward_inputs ------------------------------------------
def output_dtype_run(rank: int, world: int) -> dict:
    """bf16 compute, fp32 reduce, fp32 outputs vs a reference doing the same casts (as in
    _sharding_workers.mp_parity_run, with the logits cast to fp32 before the loss)."""
    torch.manual_seed(0)
    ref = TinyNet()
    mp = shardkit.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                 output_dtype=torch.float32)
    model = shardkit.shard(copy.deepcopy(ref), mixed_precision=mp,
                           auto_wrap_policy=shardkit.wrap.transformer_layers({Block}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    out: dict = {"dtypes": [], "loss_diffs": [], "diffs": []}
    for step in range(STEPS):
        x, y = batch(step, rank)
        logits = model(x)
        out["dtypes"].append(str(logits.dtype))
        loss = F.cross_entropy(logits, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses = mp_reference_grads(ref, step, world, output_dtype=torch.float32)
        out["loss_diffs"].append(abs(ref_losses[rank] - loss.item()))
        ref_opt.step()
        ref_opt.zero_grad()
        out["diffs"].append(max_diff(full_params(model), ref))
    # Inner units keep param_dtype outputs: the root's own layers consume them.
    seen: list[str] = []
    model.blocks[0].register_forward_hook(lambda m, a, o: seen.append(str(o.dtype)))
    with torch.no_grad():
        model(batch(0, rank)[0])
    out["inner_output_dtype"] = seen
    return out


class Recorder(nn.Module):
    """A linear layer that records the dtype of the input it is given and casts it itself."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.seen: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Record, cast to the weight's dtype, apply."""
        self.seen.append(str(x.dtype))
        return self.lin(x.to(self.lin.weight.dtype))


class RecorderNet(nn.Module):
    """A root that records its input dtype around one Recorder unit."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Recorder(6)
        self.head = nn.Linear(6, 3)
        self.seen: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Record, then inner (handed the fp32 input as is), then head in its own dtype."""
        self.seen.append(str(x.dtype))
        return self.head(self.inner(x.float()).to(self.head.weight.dtype))


def cast_inputs_run(rank: int, world: int) -> dict:
    """Which dtype each unit's forward sees with cast_forward_inputs True / False, and the outputs
    against a bf16 replica that does the same casts."""
    out: dict = {}
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    for cast in (True, False):
        torch.manual_seed(0)
        ref = RecorderNet()
        mp = shardkit.MixedPrecision(param_dtype=torch.bfloat16, cast_forward_inputs=cast)
        model = shardkit.shard(copy.deepcopy(ref), mixed_precision=mp,
                               auto_wrap_policy=lambda m: isinstance(m, Recorder))
        replica = copy.deepcopy(ref).to(torch.bfloat16)
        with torch.no_grad():
            y = model(x)
            want = replica(x.to(torch.bfloat16) if cast else x)
        out[cast] = {"root": model.seen, "inner": model.inner.seen,
                     "equal": torch.equal(y, want), "dtype": str(y.dtype)}
    return out


# ---- register_forward_method ---------------------------------------------------------------------
class MlpBlock(Block):
    """A Block with a method that uses its own layers directly, not through forward."""

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The block's MLP half with its residual."""
        return x + self.fc2(torch.relu(self.fc1(self.ln2(x))))


class EncodeNet(TinyNet):
    """TinyNet with `encode`: a second entry point that never calls forward."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MlpBlock(14) for _ in range(2))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """conv -> embed -> each block's mlp() -> pooled head, all through attributes."""
        h = self.embed(torch.relu(self.conv(x)).flatten(2).transpose(1, 2))
        for block in self.blocks:
            h = block.mlp(h)
        return self.head(self.norm(h).mean(dim=1))

    def training_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss through the model's own forward, as a Lightning step computes it."""
        return F.cross_entropy(self(x), y) + 0.0 * self.encode(x).sum()


def forward_method_run(rank: int, world: int) -> dict:
    """encode() on the root and mlp() on each block unit, trained against the reference."""
    torch.manual_seed(0)
    ref = EncodeNet()
    model = shardkit.shard(copy.deepcopy(ref), auto_wrap_policy=shardkit.wrap.transformer_layers({MlpBlock}))
    out: dict = {}
    try:
        model.encode(batch(0, rank)[0])
        out["unregistered"] = None
    except Exception as exc:  # noqa: BLE001 - what a user sees is the result
        out["unregistered"] = f"{type(exc).__name__}: {exc}"
    # A layer called directly: with row shards a Linear would return a slice of its features.
    h = torch.randn(3, 14)
    try:
        model.head(h)
        out["direct_layer"] = None
    except shardkit.ShardkitError as exc:
        out["direct_layer"] = str(exc)
    with torch.no_grad(), model.unshard():
        out["direct_in_unshard_diff"] = (model.head(h) - ref.head(h)).abs().max().item()
    shardkit.register_forward_method(model, "encode")
    for block in model.blocks:
        shardkit.register_forward_method(block, "mlp")
    shardkit.register_forward_method(model, "encode")  # a second registration changes nothing
    errors = {}
    for label, call in [("not_a_unit", lambda: shardkit.register_forward_method(model.norm, "forward")),
                        ("no_method", lambda: shardkit.register_forward_method(model, "decode"))]:
        try:
            call()
            errors[label] = None
        except shardkit.ShardkitError as exc:
            errors[label] = str(exc)
    out["errors"] = errors
    # Adam without weight decay: encode() leaves attention unused, which the engine reduces as
    # zero grads and the reference leaves None; decay would move only the former.
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    out["diffs"] = []
    for step in range(STEPS):
        x, y = batch(step, rank)
        F.cross_entropy(model.encode(x), y).backward()
        opt.step()
        opt.zero_grad()
        gx, gy = global_batch(step, world)
        F.cross_entropy(ref.encode(gx), gy).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        out["diffs"].append(max_diff(full_params(model), ref))
    with torch.no_grad():
        x = batch(9, rank)[0]
        out["eval_diff"] = (model.encode(x) - ref.encode(x)).abs().max().item()
        out["sharded_after"] = shards_exposed(model)
    out["nested"] = _nested_method_run(rank, world)
    return out


def _nested_method_run(rank: int, world: int) -> dict:
    """A registered method that calls the model's forward and another registered method inside:
    the hooks run once around it (not again inside), and training matches the reference."""
    torch.manual_seed(1)
    ref = EncodeNet()
    model = shardkit.shard(copy.deepcopy(ref), auto_wrap_policy=shardkit.wrap.transformer_layers({MlpBlock}))
    for name in ("training_step", "encode"):
        shardkit.register_forward_method(model, name)
    for block in model.blocks:
        shardkit.register_forward_method(block, "mlp")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    diffs = []
    for step in range(STEPS):
        x, y = batch(step, rank)
        model.training_step(x, y).backward()
        opt.step()
        opt.zero_grad()
        gx, gy = global_batch(step, world)
        ref.training_step(gx, gy).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        diffs.append(max_diff(full_params(model), ref))
    return {"diffs": diffs, "sharded_after": shards_exposed(model),
            "gathered": _gathered_bytes(model, *batch(0, rank))}


def _gathered_bytes(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    """All-gather bytes of one no-grad call of each entry point (the root unit's own share is
    encode's minus its blocks')."""
    def sent(call) -> int:
        shardkit.comm_stats(model, reset=True)
        with torch.no_grad():
            call()
        return shardkit.comm_stats(model)["all_gather"]

    h = torch.randn(2, 5, 14)
    return {"forward": sent(lambda: model(x)), "encode": sent(lambda: model.encode(x)),
            "blocks": sum(sent(lambda b=b: b.mlp(h)) for b in model.blocks),
            "training_step": sent(lambda: model.training_step(x, y))}


def generate_run(rank: int, world: int) -> dict | str:
    """GPT2LMHeadModel.generate (greedy) sharded per GPT2Block vs the unsharded model."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    except ImportError as exc:
        return f"transformers is not installed ({exc}); pip install 'shardkit[hf]'"
    # A wide init so greedy decoding wanders over the vocabulary instead of repeating a token.
    cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                     initializer_range=0.5, bos_token_id=0, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    ref = GPT2LMHeadModel(cfg).eval()
    model = shardkit.shard(copy.deepcopy(ref),
                           auto_wrap_policy=shardkit.wrap.transformer_layers({GPT2Block})).eval()
    ids = torch.tensor([[5 + rank, 17, 3, 42]])
    kwargs = dict(max_new_tokens=8, do_sample=False)
    want = ref.generate(ids, **kwargs)
    got_plain = model.generate(ids, **kwargs)  # generate calls forward: the hooks run anyway
    shardkit.register_forward_method(model, "generate")
    got = model.generate(ids, **kwargs)
    return {"want": want.tolist(), "plain": got_plain.tolist(), "registered": got.tolist(),
            "sharded_after": shards_exposed(model)}


def ops_suite(rank: int, world: int) -> dict:
    """Every case of tests/test_sharding_ops.py on one set of ranks."""
    return {"exact_ops": exact_ops(rank, world), "output_dtype": output_dtype_run(rank, world),
            "cast_inputs": cast_inputs_run(rank, world),
            "forward_method": forward_method_run(rank, world),
            "generate": generate_run(rank, world)}
