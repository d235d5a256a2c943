"""Measured peak memory of a sharded training step on CPU, for tests/test_planner_activations.py.

"Measured" is torch's own CPU allocator accounting, read through the profiler (profile_memory:
every allocation and free with the running total, the frees of gloo's threads included:
shardkit.planner.measure.host_memory_profiler), not RSS: the high-water mark of one forward +
backward, plus the parameter and optimizer shards alive before it (counted from the tensors).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from shardkit.planner.measure import host_memory_profiler, trace_events

MODELS = ("gpt2-small", "t5-small", "llama-tiny")


def build(name: str) -> tuple[Callable[[], torch.nn.Module], type]:
    """A factory for the model of that shape (transformers configs, no download) and its block."""
    import transformers

    if name == "gpt2-small":
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        config = transformers.GPT2Config()  # 12 x 768, the GPT-2 small shape
        return (lambda: transformers.GPT2LMHeadModel(config)), GPT2Block
    if name == "t5-small":
        from transformers.models.t5.modeling_t5 import T5Block

        config = transformers.T5Config()  # 6 + 6 x 512, the t5-small shape
        return (lambda: transformers.T5ForConditionalGeneration(config)), T5Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=32000)
    return (lambda: transformers.LlamaForCausalLM(config)), LlamaDecoderLayer


WINDOW = "shardkit_measured_window"


def allocation_peak(fn: Callable[[], None]) -> int:
    """Most bytes torch's CPU allocator held at once during fn(), above what it held before."""
    with host_memory_profiler() as prof:
        fn()
    memory = sorted((e["ts"], e["args"]["Total Allocated"], e["args"]["Bytes"])
                    for e in trace_events(prof) if e.get("name") == "[memory]")
    if not memory:
        return 0
    # The running total also counts what an earlier profiling session in this process left
    # allocated: measure from what was held just before the first event.
    held_before = memory[0][1] - memory[0][2]
    return max(total for _, total, _ in memory) - held_before


def peak_in_window(prof: Any) -> tuple[int, int]:
    """(held when the WINDOW range began, most held during it): the allocator's running total
    counts everything allocated since profiling began, so start profiling before the model."""
    events = trace_events(prof)
    (window,) = [e for e in events if e.get("name") == WINDOW and e.get("ph") == "X"]
    start, end = window["ts"], window["ts"] + window["dur"]
    memory = sorted((e["ts"], e["args"]["Total Allocated"]) for e in events
                    if e.get("name") == "[memory]")
    before = [total for ts, total in memory if ts < start]
    inside = [total for ts, total in memory if start <= ts <= end]
    return (before[-1] if before else 0), max(inside)


def token_kwargs(model: torch.nn.Module, ids: torch.Tensor) -> dict:
    """input_ids and labels (and decoder_input_ids for an encoder-decoder), as HF users train:
    without the generation cache (HF's Trainer turns it off under gradient checkpointing)."""
    extra = {"decoder_input_ids": ids} if model.config.is_encoder_decoder else {}
    return {"input_ids": ids, "labels": ids, "use_cache": False, **extra}


def measured_peak(rank: int, name: str, batch: int, seq: int, ac: bool,
                  strategy: str = "FULL_SHARD") -> dict:
    """Bytes held when a training step begins and at its high-water mark, on this rank.

    One case per process: a second profiling session in one process counted the first one's
    leftovers again (150 MiB too many "held" for llama-tiny)."""
    import shardkit
    from shardkit.wrap import checkpoint_layers, transformer_layers
    from torch.autograd.profiler import record_function

    make, block = build(name)
    # Profiled from before the model exists, so the allocator's running total is everything this
    # run holds: shards, optimizer state, kept buffers, the step's own tensors.
    with host_memory_profiler() as prof:
        torch.manual_seed(0)
        model = shardkit.shard(make(), auto_wrap_policy=transformer_layers({block}),
                               strategy=strategy)
        if ac:
            checkpoint_layers(model, block)
        opt = torch.optim.AdamW(model.parameters())
        ids = torch.randint(0, 1000, (batch, seq), generator=torch.Generator().manual_seed(rank))
        kwargs = token_kwargs(model, ids)
        model(**kwargs).loss.backward()
        opt.step()
        opt.zero_grad()  # set_to_none: the next step makes its gradient shards anew
        with record_function(WINDOW):
            model(**kwargs).loss.backward()
    held_before, peak = peak_in_window(prof)
    return {"held_before": held_before, "peak": peak}


def measured_device_peak(rank: int, name: str, batch: int, seq: int, ac: bool,
                         strategy: str = "FULL_SHARD") -> dict:
    """The device allocator's high-water mark of a warm training step (forward + backward) on
    this rank's accelerator, with what it held when the step began."""
    import shardkit
    from shardkit.wrap import checkpoint_layers, transformer_layers

    ctx = shardkit.current_context()
    make, block = build(name)
    torch.manual_seed(0)
    model = shardkit.shard(make(), auto_wrap_policy=transformer_layers({block}), strategy=strategy)
    if ac:
        checkpoint_layers(model, block)
    opt = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, 1000, (batch, seq), generator=torch.Generator().manual_seed(rank))
    kwargs = token_kwargs(model, ids.to(ctx.device))
    model(**kwargs).loss.backward()
    opt.step()
    opt.zero_grad()  # set_to_none: the next step makes its gradient shards anew
    ctx.backend.synchronize(ctx.device)
    held_before = ctx.backend.memory_stats(ctx.device)["allocated"]
    ctx.backend.reset_peak_memory(ctx.device)
    model(**kwargs).loss.backward()
    ctx.backend.synchronize(ctx.device)
    device_module = getattr(torch, ctx.device.type, None)  # torch.cuda / torch.xpu: the caching allocator
    reserved = (device_module.max_memory_reserved(ctx.device)
                if hasattr(device_module, "max_memory_reserved") else None)
    return {"held_before": held_before, "peak": ctx.backend.memory_stats(ctx.device)["peak"],
            "reserved": reserved}
