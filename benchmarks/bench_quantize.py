"""Quantized collectives (shardkit.Quantization): what int8 blocks cost in accuracy, and in bytes.

    python benchmarks/bench_quantize.py --steps 300 --json quant.json --plot quant.png

1. Convergence: a small GPT (shardkit.demo.models.GPT) learns a generated Markov-chain language
   (its entropy rate is the floor no model beats) for --steps steps, HYBRID_SHARD over 2 groups
   of 2 ranks, so both the shard group's reduction and the replicas' all-reduce are quantized,
   once per setting from the same weights and batches: exact, weights, gradients, both. Reported:
   the mean loss over the last 10 % of steps, its difference from the exact run's, and the bytes
   each rank sent per step (comm_stats).
2. Block size: the round-trip error of the trained model's weights and of one step's gradients,
   for block sizes 32 ... 4096, next to the scale bytes each adds on the wire.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
SETTINGS = ("exact", "weights", "gradients", "both")
VOCAB, CONTEXT = 64, 32


def chain(seed: int = 0) -> torch.Tensor:
    """A fixed next-token distribution: each token has 4 likely successors (a learnable language)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.full((VOCAB, VOCAB), -4.0)
    for token in range(VOCAB):
        logits[token, torch.randperm(VOCAB, generator=gen)[:4]] = torch.randn(4, generator=gen) + 2
    return logits.softmax(dim=1)


def entropy_rate(probs: torch.Tensor) -> float:
    """Nats per token of the chain at its stationary distribution: the lowest reachable loss."""
    pi = torch.ones(VOCAB) / VOCAB
    for _ in range(500):
        pi = pi @ probs
    return float(-(pi[:, None] * probs * probs.clamp_min(1e-30).log()).sum())


def sample(probs: torch.Tensor, batch: int, seed: int) -> torch.Tensor:
    """(batch, CONTEXT) token ids drawn from the chain."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.empty(batch, CONTEXT, dtype=torch.long)
    ids[:, 0] = torch.randint(0, VOCAB, (batch,), generator=gen)
    for t in range(1, CONTEXT):
        ids[:, t] = torch.multinomial(probs[ids[:, t - 1]], 1, generator=gen)[:, 0]
    return ids


def quantization(setting: str):
    """The shard() option of a setting's name."""
    import shardkit

    return {"exact": None, "weights": shardkit.Quantization(weights=True),
            "gradients": shardkit.Quantization(gradients=True),
            "both": shardkit.Quantization(weights=True, gradients=True)}[setting]


def train(rank: int, world: int, setting: str, steps: int, batch: int) -> dict:
    """One rank of one setting: its loss per step, bytes per step, and (rank 0) the weights."""
    import shardkit
    from shardkit.checkpoint import full_state_dict
    from shardkit.demo.models import GPT, GPTBlock

    probs = chain()
    torch.manual_seed(0)
    model = shardkit.shard(GPT(vocab=VOCAB, context=CONTEXT, dim=64, layers=4, heads=4),
                           strategy="HYBRID_SHARD", hybrid_group_size=world // 2,
                           auto_wrap_policy=shardkit.wrap.transformer_layers({GPTBlock}),
                           quantize=quantization(setting))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses, grads = [], None
    for step in range(steps):
        ids = sample(probs, batch, seed=step * world + rank)
        logits = model(ids)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        if step == steps - 1:
            # This rank's rows of each gradient (a DTensor's local part): what a reduction sends.
            grads = {n: getattr(p.grad, "to_local", lambda g=p.grad: g)().detach().clone()
                     for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(float(shardkit.global_mean(loss.detach())))
        if step == 0:
            shardkit.comm_stats(model, reset=True)
    per_step = {k: v // (steps - 1) for k, v in shardkit.comm_stats(model).items()
                if k in ("all_gather", "reduce_scatter", "all_reduce", "total")}
    weights = full_state_dict(model, rank0_only=False)
    return {"losses": losses, "bytes_per_step": per_step,
            "weights": {k: v for k, v in weights.items()} if rank == 0 else None,
            "grads": grads if rank == 0 else None}


def round_trip_error(tensors: dict[str, torch.Tensor], block: int) -> float:
    """Relative RMS error of quantizing every tensor in rows of `block`-sized blocks."""
    from shardkit.sharding.step.quantize import decode_rows, encode_rows

    err = total = 0.0
    for t in tensors.values():
        flat = t.detach().float().reshape(1, -1)
        back = decode_rows(encode_rows(flat, block), flat.shape[1], block)
        err += float((back - flat).pow(2).sum())
        total += float(flat.pow(2).sum())
    return math.sqrt(err / total)


def commit() -> str:
    """The checkout's short commit, or "unknown"."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, text=True,
                              capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def plot(curves: dict[str, list[float]], floor: float, path: str) -> None:
    """Loss per step of every setting (smoothed over 10 steps) with the chain's entropy, and
    below it each setting's difference from the exact run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(values: list[float]) -> list[float]:
        return [sum(values[max(0, i - 9):i + 1]) / len(values[max(0, i - 9):i + 1])
                for i in range(len(values))]

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True,
                                      gridspec_kw={"height_ratios": [2, 1]})
    colors = {}
    for name, losses in curves.items():
        (line,) = top.plot(smooth(losses), label=name)
        colors[name] = line.get_color()
    top.axhline(floor, color="grey", linestyle=":", label="entropy rate (floor)")
    top.set_ylabel("training loss (nats/token)")
    top.set_yscale("log")
    top.legend()
    top.set_title("int8 block-quantized collectives vs exact (HYBRID 2 x 2)")
    exact = curves.get("exact")
    if exact is not None:
        for name, losses in curves.items():
            if name != "exact":
                bottom.plot(smooth([q - e for q, e in zip(losses, exact)]), label=name,
                            color=colors[name])
        bottom.axhline(0.0, color="grey", linewidth=0.5)
        bottom.set_ylabel("loss - exact's")
        bottom.legend()
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    """Run every setting, print the tables, write --json and --plot."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    sys.path.insert(0, HERE)
    import bench_quantize as me  # spawned ranks import the workers by module name

    import shardkit

    world, tail = 4, max(1, args.steps // 10)
    floor = entropy_rate(chain())
    runs = {}
    for setting in args.settings.split(","):
        ranks = shardkit.spawn(me.train, world, world, setting, args.steps, args.batch,
                               threads_per_rank=1)
        runs[setting] = ranks[0]
        losses = ranks[0]["losses"]
        print(f"{setting}: final {sum(losses[-tail:]) / tail:.4f}", flush=True)
    exact = runs.get("exact")
    summary = {}
    for setting, run in runs.items():
        final = sum(run["losses"][-tail:]) / tail
        summary[setting] = {
            "final_loss": final,
            "vs_exact": final - sum(exact["losses"][-tail:]) / tail if exact else None,
            "bytes_per_step": run["bytes_per_step"]}
    blocks = {b: {"weights": round_trip_error(exact["weights"], b),
                  "gradients": round_trip_error(exact["grads"], b),
                  "scale_overhead": 4 / b} for b in (32, 64, 128, 256, 512, 1024, 4096)} \
        if exact else {}
    print(f"HYBRID_SHARD 2 groups x 2 ranks, GPT vocab {VOCAB} ctx {CONTEXT} dim 64 x 4 layers, "
          f"{args.steps} AdamW steps, batch {args.batch} per rank; torch {torch.__version__}, "
          f"commit {commit()}; entropy floor {floor:.4f} nats/token")
    print(f"{'setting':<10}{'final loss':>11}{'vs exact':>10}{'bytes/step/rank':>17}{'vs exact':>10}")
    base = exact["bytes_per_step"]["total"] if exact else None
    for setting, row in summary.items():
        total = row["bytes_per_step"]["total"]
        print(f"{setting:<10}{row['final_loss']:11.4f}"
              f"{(row['vs_exact'] or 0):+10.4f}{total:17d}"
              f"{(total / base if base else float('nan')):10.3f}")
    if blocks:
        print(f"{'block':>6}{'weights rel. RMS':>18}{'grads rel. RMS':>16}{'scale bytes':>13}")
        for b, row in blocks.items():
            print(f"{b:6d}{row['weights']:18.2e}{row['gradients']:16.2e}"
                  f"{row['scale_overhead']:13.2%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "floor": floor, "summary": summary, "blocks": blocks,
                       "curves": {k: v["losses"] for k, v in runs.items()},
                       "torch": torch.__version__, "commit": commit()}, f, indent=1)
    if args.plot:
        plot({k: v["losses"] for k, v in runs.items()}, floor, args.plot)


if __name__ == "__main__":
    main()
