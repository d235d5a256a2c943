"""Per-rank workers for the quantized collectives (module-level so shardkit.spawn can pickle them).

The expected values are computed in every rank from every rank's inputs (each rank can make all
of them: they come from seeds) with the pure encode/decode pair, whose own error bound
tests/test_quantize.py checks against the int8 rounding formula.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import shardkit
from shardkit import Quantization
from shardkit.sharding.setup.groups import GroupMaker, make_node_hops
from shardkit.sharding.step.comms import QuantizedReplicaReduce, QuantizedScatter
from shardkit.sharding.step.quantize import decode_rows, encode_rows
from shardkit.sharding.step.reduce_ops import ReducePlan
from shardkit.sharding.step.traffic import CommStats

BLOCK = 64
ROW = 150  # per destination rank: two whole blocks and a padded third


def inputs_of(rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s (world, ROW) reduce-scatter input: varied magnitudes and one outlier."""
    g = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(world, ROW, generator=g) * torch.logspace(-3, 1, ROW)
    x[rank % world, 3] = 50.0  # an outlier spoils only its own block's resolution
    return x


def round_trip(rows: torch.Tensor) -> torch.Tensor:
    """What a quantized hop delivers of `rows` (2-D)."""
    return decode_rows(encode_rows(rows, BLOCK), rows.shape[1], BLOCK)


def one_hop_expected(rank: int, world: int) -> torch.Tensor:
    """Sum over senders of each one's quantized row for `rank`."""
    return sum(round_trip(inputs_of(j, world)[rank:rank + 1])[0] for j in range(world))


def two_hop_expected(rank: int, world: int, per_node: int) -> torch.Tensor:
    """Node sums of the quantized rows first, then the quantized node sums across nodes."""
    nodes, position = world // per_node, rank % per_node
    total = torch.zeros(ROW)
    for n in range(nodes):
        node_sum = sum(round_trip(inputs_of(n * per_node + peer, world)[rank:rank + 1])[0]
                       for peer in range(per_node))
        total += round_trip(node_sum.view(1, -1))[0]
    assert position == rank % per_node
    return total


def all_reduce_expected(world: int, numel: int) -> torch.Tensor:
    """Each slice summed from quantized inputs, then the sums quantized once more."""
    width = -(-numel // world)
    padded = [F.pad(inputs_of(j, world).reshape(-1)[:numel], (0, world * width - numel))
              for j in range(world)]
    sums = [sum(round_trip(p.view(world, width)[c:c + 1])[0] for p in padded)
            for c in range(world)]
    return round_trip(torch.stack(sums)).reshape(-1)[:numel]


def _scatter(inp: torch.Tensor, ctx, stats: CommStats, hops=None) -> torch.Tensor:
    out = torch.empty(inp.shape[1])
    work, finish = QuantizedScatter(ctx.backend, stats, BLOCK, hops).launch(out, inp, ctx.world,
                                                                            ReducePlan())
    work.wait()
    finish(ctx.backend.current_stream(ctx.device))
    return out


def collectives(rank: int, world: int) -> dict:
    """The quantized reduce-scatter (one hop, two hops over 2-rank nodes) and all-reduce."""
    ctx = shardkit.current_context()
    x = inputs_of(rank, world)
    out: dict = {}
    stats = CommStats()
    got = _scatter(x.clone(), ctx, stats)
    out["one_hop"] = (got - one_hop_expected(rank, world)).abs().max().item()
    out["one_hop_vs_exact"] = (got - sum(inputs_of(j, world)[rank] for j in range(world))).abs().max().item()
    out["one_hop_bytes"] = stats.snapshot()["reduce_scatter"]
    if world % 2 == 0 and world > 2:
        hops = make_node_hops(GroupMaker(ctx.backend), ctx.world, ctx.world, ranks_per_node=2)
        stats = CommStats(ranks_per_node=2)
        got = _scatter(x.clone(), ctx, stats, hops)
        out["two_hop"] = (got - two_hop_expected(rank, world, 2)).abs().max().item()
        snap = stats.snapshot()
        out["two_hop_bytes"] = (snap["reduce_scatter"], snap["inter_node"]["reduce_scatter"])
        stats = CommStats(ranks_per_node=2)
        _scatter(x.clone(), ctx, stats)
        snap = stats.snapshot()
        out["one_hop_split"] = (snap["reduce_scatter"], snap["inter_node"]["reduce_scatter"])
    numel = world * ROW - 5  # not a multiple of the world: the last slice is padded
    flat = x.reshape(-1)[:numel].clone()
    stats = CommStats()
    QuantizedReplicaReduce(ctx.backend, stats, BLOCK).all_reduce(flat, ctx.world, "sum", None)
    out["all_reduce"] = (flat - all_reduce_expected(world, numel)).abs().max().item()
    out["all_reduce_bytes"] = stats.snapshot()["all_reduce"]
    out["all_reduce_value"] = flat.sum().item()  # the same on every rank
    return out


class Wide(torch.nn.Module):
    """A bias-free 300 x 8 linear (its own unit: dim-0 shards of 300 / world rows) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(8, 300, bias=False)
        self.head = torch.nn.Linear(300, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (batch, 8)."""
        return self.head(self.body(x))


def gathered_weight(rank: int, world: int) -> dict:
    """The weight a unit computes with under Quantization(weights=True): each rank's row decoded."""
    torch.manual_seed(0)
    model = Wide()
    exact = model.body.weight.detach().clone()
    seen: list[torch.Tensor] = []
    model.body.register_forward_hook(lambda m, i, o: seen.append(m.weight.detach().clone()))
    model = shardkit.shard(model, auto_wrap_policy=lambda m: m is model.body,
                           quantize=Quantization(weights=True, block_size=BLOCK))
    model(torch.randn(4, 8)).sum().backward()
    expected = round_trip(exact.reshape(world, -1)).reshape(exact.shape)
    return {"diff": (seen[0] - expected).abs().max().item(),
            "vs_exact": (seen[0] - exact).abs().max().item(),
            "master_exact": (shardkit.full_tensor(model.body.weight) - exact).abs().max().item(),
            "gathers": shardkit.comm_stats(model)["all_gather"]}


SETTINGS = {"weights": Quantization(weights=True), "gradients": Quantization(gradients=True),
            "both": Quantization(weights=True, gradients=True)}


def training(rank: int, world: int, runs: list[tuple[str, str, dict]]) -> dict:
    """parity_run (5 SGD steps beside an unsharded reference on the global batch) per (strategy,
    setting, extra shard kwargs; "checkpoint_layers": True checkpoints every block's activations);
    with each run's final parameters' digest, to compare ranks."""
    from _knob_workers import _checkpoint_blocks
    from _sharding_workers import full_params, parity_run

    out = {}
    for strategy, setting, extra in runs:
        kept: list = []
        kwargs = {**extra, "quantize": SETTINGS[setting]} if setting != "exact" else dict(extra)
        checkpointed = kwargs.pop("checkpoint_layers", False)  # activation checkpointing

        def setup(model, checkpointed=checkpointed, kept=kept):
            kept.append(model)
            if checkpointed:
                _checkpoint_blocks(model)

        result = parity_run(rank, strategy, world, kwargs, optimizer="sgd", setup=setup)
        params = full_params(kept[0])
        digest = [float(v.double().sum()) for _, v in sorted(params.items())]
        out[f"{strategy}/{setting}/{sorted(extra)}"] = {"diffs": result["diffs"],
                                                        "digest": digest}
    return out


def mixed_precision_training(rank: int, world: int) -> dict:
    """bf16 compute + fp32 reduce, 5 SGD steps, quantized both ways and unquantized from the same
    weights and batches: the largest weight difference after each step."""
    from _models import Block, TinyNet, batch
    from _sharding_workers import full_params

    mp = shardkit.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    models, opts = [], []
    for q in (None, SETTINGS["both"]):
        torch.manual_seed(0)
        models.append(shardkit.shard(TinyNet(), mixed_precision=mp, quantize=q,
                                     auto_wrap_policy=shardkit.wrap.transformer_layers({Block})))
        opts.append(torch.optim.SGD(models[-1].parameters(), lr=1e-2))
    diffs = []
    for step in range(5):
        x, y = batch(step, rank)
        for model, opt in zip(models, opts):
            F.cross_entropy(model(x).float(), y).backward()
            opt.step()
            opt.zero_grad()
        exact, quantized = (full_params(m) for m in models)
        diffs.append(max((exact[k] - quantized[k]).abs().max().item() for k in exact))
    return {"diffs": diffs}


def step_bytes(rank: int, world: int, cases: list, settings: list) -> dict:
    """comm_stats of the second AdamW step of a TinyNet per (strategy, hybrid group) x setting."""
    from _models import Block, TinyNet, batch

    out = {}
    for strategy, group in cases:
        for q in settings:
            if strategy == "NO_SHARD" and q.weights:
                continue  # refused: NO_SHARD gathers no weights to quantize
            torch.manual_seed(0)
            model = shardkit.shard(TinyNet(), strategy=strategy, quantize=q,
                                   auto_wrap_policy=shardkit.wrap.transformer_layers({Block}),
                                   **({"hybrid_group_size": group} if group else {}))
            opt = torch.optim.AdamW(model.parameters())
            for step in range(2):
                shardkit.comm_stats(model, reset=True)
                x, y = batch(step, rank)
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
            out[f"{strategy}/{q}"] = shardkit.comm_stats(model)
    return out
