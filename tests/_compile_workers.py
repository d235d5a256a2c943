"""Per-rank workers: units compiled the way users compile blocks, against eager and FSDP2."""

from __future__ import annotations

import contextlib

import torch

import shardkit
from shardkit.wrap import checkpoint_layers, transformer_layers

STEPS = 5
# name -> shard() options; "ac" and "no_sync" change the loop, not the options.
CONFIGS = {
    "FULL_SHARD": {"strategy": "FULL_SHARD"},
    "SHARD_GRAD_OP": {"strategy": "SHARD_GRAD_OP"},
    "NO_SHARD": {"strategy": "NO_SHARD"},
    "HYBRID_SHARD": {"strategy": "HYBRID_SHARD", "hybrid_group_size": 1},
    "reshard_to_2": {"reshard_after_forward": 2},
    "bf16": {"mixed_precision": "bf16"},
    "cpu_offload": {"cpu_offload": True},
    "prefetch_2": {"prefetch": 2},
    "ac": {},
    "no_sync": {},
    "torch.compile(block)": {},  # the blocks replaced by torch.compile(block), not block.compile()
}


def _gpt2():
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=128, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    return model, type(model.transformer.h[0])


def _options(name: str) -> dict:
    return _options_from(CONFIGS[name])


def _build(name: str, engine: str):
    model, block = _gpt2()
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.transformer.h:
            fully_shard(layer)
        fully_shard(model)
    else:
        model = shardkit.shard(model, auto_wrap_policy=transformer_layers({block}), **_options(name))
    if name == "ac":
        checkpoint_layers(model, block)
    return model


def _train(model, rank: int, name: str, after_step) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(100 + rank)
    losses = []
    for step in range(STEPS):
        ids = torch.randint(0, 128, (2, 16), generator=gen)
        # no_sync: every other step accumulates without reducing, the next one reduces both.
        quiet = model.no_sync() if name == "no_sync" and step % 2 == 0 else contextlib.nullcontext()
        with quiet:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        if not (name == "no_sync" and step % 2 == 0):
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
        after_step()
    return losses


def compiled_blocks(rank: int, world: int, names: list[str], fsdp2: bool) -> dict:
    """Per config: eager losses, then each block.compile(backend="aot_eager") after sharding:
    losses, dynamo's graph count after every step and its graph breaks (FSDP2 alike if asked)."""
    from torch._dynamo.utils import counters

    shardkit.init()
    out = {}
    runs = [(name, "shardkit") for name in names]
    if fsdp2:  # torch's own, compiled the two ways users do
        runs += [("FULL_SHARD", "fsdp2"), ("torch.compile(block)", "fsdp2")]
    for name, engine in runs:
        eager = _train(_build(name, engine), rank, name, lambda: None) if engine == "shardkit" else None
        torch._dynamo.reset()
        counters.clear()
        model = _build(name, engine)
        for i, layer in enumerate(model.transformer.h):
            if name == "torch.compile(block)":
                model.transformer.h[i] = torch.compile(layer, backend="aot_eager")
            else:
                layer.compile(backend="aot_eager")
        graphs: list[int] = []
        losses = _train(model, rank, name,
                        lambda graphs=graphs: graphs.append(counters["stats"]["unique_graphs"]))
        out[f"{engine}:{name}"] = {"eager": eager, "compiled": losses, "graphs": graphs,
                                   "breaks": sum(counters["graph_break"].values())}
    return out


def compiled_model(rank: int, world: int) -> dict:
    """torch.compile(model) on the whole sharded model, 10 steps, shardkit and FSDP2 alike."""
    from torch._dynamo.utils import counters

    global STEPS
    shardkit.init()
    eager = _train(_build("FULL_SHARD", "shardkit"), rank, "FULL_SHARD", lambda: None)
    out: dict = {"eager": eager}
    saved, STEPS = STEPS, 10
    try:
        for engine in ("shardkit", "fsdp2"):
            torch._dynamo.reset()
            counters.clear()
            model = torch.compile(_build("FULL_SHARD", engine), backend="aot_eager")
            graphs: list[int] = []
            losses = _train(model, rank, "FULL_SHARD",
                            lambda graphs=graphs: graphs.append(counters["stats"]["unique_graphs"]))
            out[engine] = {"compiled": losses, "graphs": graphs,
                           "breaks": sum(counters["graph_break"].values())}
    finally:
        STEPS = saved
    return out


FULLGRAPH_OPTIONS = {
    "FULL_SHARD": {},
    "SHARD_GRAD_OP": {"strategy": "SHARD_GRAD_OP"},
    "HYBRID_SHARD": {"strategy": "HYBRID_SHARD", "hybrid_group_size": 1},
    "reshard_to_2": {"reshard_after_forward": 2},
    "bf16": {"mixed_precision": "bf16"},
    "quantized": {"quantize": "both"},
}


def _tiny_gpt():
    from shardkit.demo.models import GPT

    torch.manual_seed(0)
    model = GPT(vocab=64, context=16, dim=32, layers=3, heads=4)
    return model, type(model.blocks[0])


def _fullgraph_batches(world: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 64, (2 * world, 16), generator=gen) for _ in range(STEPS)]


def _lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                             ids[:, 1:].reshape(-1))


def compiled_fullgraph(rank: int, world: int, name: str) -> dict:
    """torch.compile(model, fullgraph=True) on a sharded GPT: its losses and final weights, the
    unsharded model's trained in this process on the whole global batch, dynamo's graph and
    break counts, and the bytes gathered per step next to the same model run eagerly."""
    from torch._dynamo.utils import counters

    from shardkit.checkpoint import full_state_dict

    shardkit.init()
    batches = _fullgraph_batches(world)
    mine = [b[2 * rank:2 * rank + 2] for b in batches]
    options = _options_from(FULLGRAPH_OPTIONS[name])

    reference, _ = _tiny_gpt()
    opt = torch.optim.SGD(reference.parameters(), lr=0.05)  # Adam would amplify rounding
    for ids in batches:
        if name == "bf16":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = _lm_loss(reference(ids), ids)
        else:
            loss = _lm_loss(reference(ids), ids)
        loss.backward()
        opt.step()
        opt.zero_grad()

    out: dict = {"reference": {k: v.detach().clone() for k, v in reference.state_dict().items()}}
    for mode in ("eager", "compiled"):
        model, block = _tiny_gpt()
        model = shardkit.shard(model, auto_wrap_policy=transformer_layers({block}), **options)
        torch._dynamo.reset()
        counters.clear()
        run = torch.compile(model, fullgraph=True, backend="aot_eager") if mode == "compiled" else model
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses, graphs, gathered = [], [], []
        for ids in mine:
            shardkit.comm_stats(model, reset=True)
            loss = _lm_loss(run(ids), ids)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            graphs.append(counters["stats"]["unique_graphs"])
            gathered.append(shardkit.comm_stats(model)["all_gather"])
        out[mode] = {"losses": losses, "graphs": graphs, "gathered": gathered,
                     "breaks": sum(counters["graph_break"].values()),
                     "weights": full_state_dict(model, rank0_only=False)}
    return out


def _options_from(options: dict) -> dict:
    options = dict(options)
    if options.get("mixed_precision") == "bf16":
        options["mixed_precision"] = shardkit.MixedPrecision(param_dtype=torch.bfloat16,
                                                             reduce_dtype=torch.float32)
    if options.get("quantize") == "both":
        options["quantize"] = shardkit.Quantization(weights=True, gradients=True)
    if options.get("mixed_precision") == "buffers":
        options["mixed_precision"] = shardkit.MixedPrecision(buffer_dtype=torch.float64)
    return options


def no_sync_error(rank: int) -> str:
    """The error no_sync() gets from a backward through a whole-model compiled graph."""
    model, block = _tiny_gpt()
    model = shardkit.shard(model, auto_wrap_policy=transformer_layers({block}))
    run = torch.compile(model, fullgraph=True, backend="aot_eager")
    ids = torch.randint(0, 64, (2, 16))
    try:
        with model.no_sync():
            _lm_loss(run(ids), ids).backward()
    except shardkit.ShardkitError as exc:
        return str(exc)
    return "no error"


def fsdp2_fullgraph_outcome(rank: int) -> str:
    """What torch.compile(model, fullgraph=True) does to the same GPT under torch's FSDP2."""
    from torch.distributed.fsdp import fully_shard

    shardkit.init()
    model, _ = _tiny_gpt()
    for layer in model.blocks:
        fully_shard(layer)
    fully_shard(model)
    run = torch.compile(model, fullgraph=True, backend="aot_eager")
    ids = torch.randint(0, 64, (2, 16))
    try:
        _lm_loss(run(ids), ids).backward()
    except Exception as exc:  # noqa: BLE001 - the peer's failure, whatever its type, is the finding
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return "ran"


def fullgraph_refusal(rank: int, options: dict) -> str:
    """What torch.compile(model, fullgraph=True) says of a setting that keeps the eager hooks."""
    model, block = _tiny_gpt()
    model = shardkit.shard(model, auto_wrap_policy=transformer_layers({block}),
                           **_options_from(options))
    run = torch.compile(model, fullgraph=True, backend="aot_eager")
    ids = torch.randint(0, 64, (2, 16))
    try:
        _lm_loss(run(ids), ids).backward()
    except Exception as exc:  # noqa: BLE001 - dynamo wraps the error; its text is the finding
        return str(exc)
    return "no error"


def compiled_uneven_rows(rank: int, world: int, cache_dir: str) -> dict:
    """torch.compile(model) (inductor) of a model whose parameters split into unequal rows (7
    rows over 2 ranks: 4 and 3), with `cache_dir` as inductor's on-disk cache, which ranks and
    runs share as they do on one machine: per step, the weights' difference from the unsharded
    model, and how many compiled graphs came from that cache."""
    import copy
    import os

    import torch.nn.functional as F
    from torch._dynamo.utils import counters

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.ReLU(), torch.nn.Linear(7, 5))
    ref = copy.deepcopy(net)
    model = torch.compile(shardkit.shard(net))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    diffs = []
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(4 * world, 6, generator=gen), torch.randint(0, 5, (4 * world,), generator=gen)
        mine = slice(4 * rank, 4 * (rank + 1))
        F.cross_entropy(model(x[mine]), y[mine]).backward()
        opt.step()
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        diffs.append(max((p.full_tensor() - r).abs().max().item()
                         for p, r in zip(net.parameters(), ref.parameters())))
    return {"diffs": diffs, "cache_hits": counters["inductor"]["fxgraph_cache_hit"]}
