"""Model families the planner's upper-bound check uses, built from transformers configs (no
download), each with its unit classes and the inputs a training step feeds it.

Kept apart from tests/_planner_act_workers.py (GPT-2, T5, Llama): issue 34 asks for families
the other planner tests do not use — an encoder, an encoder-decoder, a grouped-query decoder,
a vision transformer and a mixture-of-experts decoder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

FAMILIES = ("bert", "bart", "qwen2", "vit", "qwen2-moe")


@dataclass(frozen=True)
class Family:
    """A model factory, its transformer-layer classes, and inputs(batch, seq, device)."""

    make: Callable[[], torch.nn.Module]
    blocks: tuple[type, ...]
    inputs: Callable[[int, int, object], tuple[tuple, dict]]


def _token_inputs(encoder_decoder: bool = False) -> Callable:
    def make(batch: int, seq: int, device: object) -> tuple[tuple, dict]:
        # Ids from 2 up: no padding or special token, which HF models treat apart.
        ids = 2 + (torch.arange(batch * seq, device=device).reshape(batch, seq) * 7919) % 998
        kwargs = {"input_ids": ids, "labels": ids}
        if encoder_decoder:
            kwargs["decoder_input_ids"] = ids
        if not encoder_decoder:
            return (), kwargs
        return (), {**kwargs, "use_cache": False}
    return make


def _image_inputs(batch: int, seq: int, device: object) -> tuple[tuple, dict]:
    # seq is the image side in pixels for a vision model.
    pixels = torch.ones(batch, 3, seq, seq, device=device)
    labels = torch.zeros(batch, dtype=torch.long, device=device)
    return (), {"pixel_values": pixels, "labels": labels}


def family(name: str) -> Family:
    """The named family's small config (sizes chosen so a 2-rank CPU step takes seconds)."""
    import transformers

    if name == "bert":
        from transformers.models.bert.modeling_bert import BertLayer

        config = transformers.BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                         intermediate_size=1024, vocab_size=8000)
        return Family(lambda: transformers.BertForMaskedLM(config), (BertLayer,), _token_inputs())
    if name == "bart":
        from transformers.models.bart.modeling_bart import BartDecoderLayer, BartEncoderLayer

        config = transformers.BartConfig(d_model=256, encoder_layers=3, decoder_layers=3,
                                         encoder_attention_heads=4, decoder_attention_heads=4,
                                         encoder_ffn_dim=1024, decoder_ffn_dim=1024,
                                         vocab_size=8000, max_position_embeddings=512)
        return Family(lambda: transformers.BartForConditionalGeneration(config),
                      (BartEncoderLayer, BartDecoderLayer), _token_inputs(encoder_decoder=True))
    if name == "qwen2":
        from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

        config = transformers.Qwen2Config(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                          num_attention_heads=8, num_key_value_heads=2,
                                          vocab_size=8000, tie_word_embeddings=False)
        return Family(lambda: transformers.Qwen2ForCausalLM(config), (Qwen2DecoderLayer,),
                      _token_inputs())
    if name == "vit":
        from transformers.models.vit.modeling_vit import ViTLayer

        config = transformers.ViTConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                        intermediate_size=1024, image_size=224, patch_size=16,
                                        num_labels=10)
        return Family(lambda: transformers.ViTForImageClassification(config), (ViTLayer,),
                      _image_inputs)
    if name == "qwen2-moe":
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeDecoderLayer

        config = transformers.Qwen2MoeConfig(hidden_size=256, intermediate_size=512,
                                             moe_intermediate_size=256,
                                             shared_expert_intermediate_size=256, num_experts=4,
                                             num_experts_per_tok=2, num_hidden_layers=3,
                                             num_attention_heads=8, num_key_value_heads=2,
                                             vocab_size=8000)
        return Family(lambda: transformers.Qwen2MoeForCausalLM(config), (Qwen2MoeDecoderLayer,),
                      _token_inputs())
    raise ValueError(f"unknown family {name!r}; one of {FAMILIES}")


def measured_family_peak(rank: int, name: str, batch: int, seq: int, ac: bool, bf16: bool,
                         strategy: str = "FULL_SHARD", cpu_offload: bool = False,
                         hybrid_group_size: int | None = None) -> dict:
    """This rank's allocator high-water mark over the second training step (forward, backward,
    AdamW's step) of the family's model (bf16: MixedPrecision(param_dtype=bfloat16)), and what
    was held as that step began: on the host torch's CPU allocator total from the profiler
    (under cpu_offload the device is the host too: the shards, gradients and optimizer state
    are subtracted, counted from the tensors), on an accelerator max_memory_allocated."""
    import contextlib

    from torch.autograd.profiler import record_function

    import shardkit
    from shardkit.planner.measure import host_memory_profiler

    from _planner_act_workers import WINDOW, peak_in_window

    ctx = shardkit.current_context()
    on_host = ctx.device.type == "cpu"
    with host_memory_profiler() if on_host else contextlib.nullcontext() as prof:
        model, opt, args, kwargs = _trained_once(family(name), batch, seq, ac, bf16, strategy,
                                                 cpu_offload, hybrid_group_size, ctx.device)
        ctx.backend.synchronize(ctx.device)
        held = ctx.backend.memory_stats(ctx.device)["allocated"]
        ctx.backend.reset_peak_memory(ctx.device)
        with record_function(WINDOW) if on_host else contextlib.nullcontext():
            model(*args, **kwargs).loss.backward()
            opt.step()
        ctx.backend.synchronize(ctx.device)
        host = _host_bytes(model, opt) if cpu_offload and on_host else 0
        opt.zero_grad()
    if on_host:
        held, peak = peak_in_window(prof)
        return {"held_before": held - host, "peak": peak - host, "host": host}
    module = getattr(torch, ctx.device.type)
    return {"held_before": held, "peak": ctx.backend.memory_stats(ctx.device)["peak"],
            "reserved": module.max_memory_reserved(ctx.device), "host": 0}


def _trained_once(fam: Family, batch: int, seq: int, ac: bool, bf16: bool, strategy: str,
                  cpu_offload: bool, hybrid_group_size: int | None, device: torch.device):
    """The family's model sharded, with AdamW and its inputs, after one training step."""
    import shardkit
    from shardkit.wrap import checkpoint_layers, transformer_layers

    mp = shardkit.MixedPrecision(param_dtype=torch.bfloat16) if bf16 else None
    torch.manual_seed(0)
    model = shardkit.shard(fam.make(), auto_wrap_policy=transformer_layers(set(fam.blocks)),
                           mixed_precision=mp, strategy=strategy, cpu_offload=cpu_offload,
                           hybrid_group_size=hybrid_group_size)
    if ac:
        checkpoint_layers(model, fam.blocks)
    opt = torch.optim.AdamW(model.parameters())
    args, kwargs = fam.inputs(batch, seq, device)
    model(*args, **kwargs).loss.backward()
    opt.step()
    opt.zero_grad()
    return model, opt, args, kwargs


def _host_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of the shards, their gradients and the optimizer's state (cpu_offload's host side)."""
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters()
                                                 if p.grad is not None]
    tensors += [v for state in opt.state.values() for v in state.values()
                if isinstance(v, torch.Tensor)]
    tensors = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]  # DTensors
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def edge_runs(rank: int, name: str, batches: tuple[int, ...], seq: int, budget: int) -> list[dict]:
    """On a GPU capped to `budget` bytes: for each batch, whether two training steps ran out of
    memory, and the most the caching allocator reserved."""
    import shardkit

    ctx = shardkit.current_context()
    module = getattr(torch, ctx.device.type)
    total = module.get_device_properties(ctx.device).total_memory
    module.set_per_process_memory_fraction(budget / total, ctx.device)
    out = []
    for batch in batches:
        module.empty_cache()
        module.reset_peak_memory_stats(ctx.device)
        try:
            model, opt, args, kwargs = _trained_once(family(name), batch, seq, False, False,
                                                     "FULL_SHARD", False, None, ctx.device)
            model(*args, **kwargs).loss.backward()
            opt.step()
            ctx.backend.synchronize(ctx.device)
            oom = False
        except module.OutOfMemoryError:
            oom = True
        model = opt = args = kwargs = None
        out.append({"batch": batch, "oom": oom,
                    "reserved": int(module.max_memory_reserved(ctx.device))})
    return out
