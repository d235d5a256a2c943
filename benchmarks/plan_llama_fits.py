"""What fits for Llama-2 shapes on 80 GiB GPUs, as the planner answers it (shapes only: any machine).

Prints, per model and world size, the largest per-rank batch of 4096-token samples for FULL_SHARD
(without and with activation checkpointing, with checkpointing and cpu_offload), SHARD_GRAD_OP
with checkpointing and NO_SHARD, and the fewest ranks for batch 1 with checkpointing; bf16
compute, fp32 reduce, AdamW, planned for the cuda backend (its attention kernels, cuBLAS
workspace, no host buffer pool). `--headroom` is the allocator's share kept free (default 0:
allocated peaks, comparable with published runs); the cuda backend's own default is 0.45.

    python benchmarks/plan_llama_fits.py [--sizes 7b,13b,70b] [--ranks 8,64] [--headroom 0]
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = {  # Llama-2's published configurations
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32),
    "13b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                num_attention_heads=40, num_key_value_heads=40),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8),
}


def meta_llama(size: str) -> torch.nn.Module:
    """Llama-2 of that size ("7b", ...) as transformers builds it, on the meta device."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=32000, **SHAPES[size])
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def planned_as_trained() -> dict:
    """The plan options these tables share: decoder layers as units, AdamW, bf16 compute with
    fp32 reduction, the cuda backend's kernels and margins."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import shardkit
    from shardkit.wrap import transformer_layers

    return dict(auto_wrap_policy=transformer_layers({LlamaDecoderLayer}), optimizer="adamw",
                mixed_precision=shardkit.MixedPrecision(param_dtype=torch.bfloat16,
                                                        reduce_dtype=torch.float32),
                backend="cuda")


def main() -> None:
    """Print the table's rows."""
    from shardkit.planner import largest_batch, smallest_world_size

    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="7b,13b,70b")
    parser.add_argument("--ranks", default="8,64")
    parser.add_argument("--headroom", type=float, default=0.0)
    args = parser.parse_args()
    budget, seq = 80 << 30, 4096
    options = dict(planned_as_trained(), headroom=args.headroom)
    print("| model | ranks | FULL_SHARD | + --ac | + --ac --cpu-offload | SHARD_GRAD_OP --ac | "
          "NO_SHARD | fewest ranks for batch 1 with --ac | seconds |")
    print("|---|---|---|---|---|---|---|---|---|")
    for size in args.sizes.split(","):
        model = meta_llama(size)
        for ranks in (int(r) for r in args.ranks.split(",")):
            start = time.perf_counter()
            cells = []
            for strategy, ac, offload in (("FULL_SHARD", False, False), ("FULL_SHARD", True, False),
                                          ("FULL_SHARD", True, True), ("SHARD_GRAD_OP", True, False),
                                          ("NO_SHARD", False, False)):
                fit = largest_batch(model, ranks, budget, seq, strategy=strategy,
                                    activation_checkpointing=ac, cpu_offload=offload, **options)
                peak = fit.plan.peak_bytes / 2**30
                cells.append(f"{fit.batch} ({peak:.1f} GiB)")
            fewest = smallest_world_size(model, budget, 1, seq, activation_checkpointing=True,
                                         **options)
            print(f"| {size} | {ranks} | " + " | ".join(cells)
                  + f" | {fewest.world_size} | {time.perf_counter() - start:.0f} |", flush=True)


if __name__ == "__main__":
    main()
