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
    options = dict(CONFIGS[name])
    if options.get("mixed_precision") == "bf16":
        options["mixed_precision"] = shardkit.MixedPrecision(param_dtype=torch.bfloat16,
                                                             reduce_dtype=torch.float32)
    return options


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
