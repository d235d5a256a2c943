"""When tensor parallelism pays, as the planner answers it: Llama-2 shapes at 8-64 ranks (shapes
only: any machine, no GPU).

Per model, world size and TP degree (1 = shardkit alone), at the same global batch everywhere (one
4096-token sample per rank of the world per step: a TP group of t ranks shares a batch of t, as
its data-parallel rank), without activation checkpointing: the peak per rank, the bytes each rank
sends per step over the data-parallel dimension and over TP, and the most any rank sends to
another node (nodes of 8 ranks, TP inside a node). bf16 compute, fp32 reduce, AdamW, planned for
the cuda backend; TP is transformers' own Llama plan (colwise q/k/v/gate/up, rowwise o/down,
the embedding rowwise, lm_head colwise with its logits gathered), which `plan(tp=)` reads from
the model (`shardkit plan --hf-config llama --tp N`).

    python benchmarks/plan_tp_pays.py [--sizes 7b,13b] [--ranks 8,16,32,64] [--tp 1,2,4,8]
"""

from __future__ import annotations

import argparse
import time

from plan_llama_fits import meta_llama, planned_as_trained


def main() -> None:
    """Print the table's rows (markdown)."""
    import shardkit

    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="7b,13b")
    parser.add_argument("--ranks", default="8,16,32,64")
    parser.add_argument("--tp", default="1,2,4,8")
    parser.add_argument("--seq", type=int, default=4096)
    args = parser.parse_args()
    options = dict(planned_as_trained(), seq=args.seq)
    print("| model | ranks | TP x DP | peak / rank | persistent / rank | DP sent / rank | "
          "TP sent / rank | most sent to another node | seconds |")
    print("|---|---|---|---|---|---|---|---|---|")
    for size in args.sizes.split(","):
        model = meta_llama(size)
        for ranks in (int(r) for r in args.ranks.split(",")):
            for tp in (int(t) for t in args.tp.split(",")):
                start = time.perf_counter()
                plan = shardkit.plan(model, ranks, tp=tp if tp > 1 else None, batch=tp,
                                     nodes=max(ranks // 8, 1), **options)
                tp_sent = plan.comm["tp"]["total"] if tp > 1 else 0
                across = max(r["total"] for r in plan.comm["inter_node_by_rank"])
                print(f"| {size} | {ranks} | {tp} x {ranks // tp} | {_gib(plan.peak_bytes)} | "
                      f"{_gib(plan.persistent['total'])} | {_gib(plan.comm['total'])} | "
                      f"{_gib(tp_sent)} | {_gib(across)} | {time.perf_counter() - start:.0f} |",
                      flush=True)


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


if __name__ == "__main__":
    main()
