"""Lightning Trainer on shardkit against Lightning's DDPStrategy: s/step and peak RSS per rank.

    python benchmarks/bench_lightning.py --model gpt2-small --devices 2 --batch 2 --seq 128 --steps 6

Each strategy runs as its own Lightning job (Lightning launches the ranks), on the same
LightningModule (a transformers GPT-2 of the given shape, AdamW), data and seed; one table with
ratios against DDP. Lightning's FSDPStrategy needs a GPU (it refuses the CPU), so on CPU DDP is
the peer; `--strategies shardkit,fsdp --accelerator cuda` compares it where one is lent.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

SHAPES = {"gpt2-small": (12, 768, 12), "gpt2-medium": (24, 1024, 16), "gpt-tiny": (2, 64, 2)}
VOCAB = 50257


def _worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import GPT2Config, GPT2LMHeadModel

    import shardkit  # noqa: F401 - strategy="shardkit"

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            layers, dim, heads = SHAPES[args.model]
            self.net = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=args.seq,
                                                  n_embd=dim, n_layer=layers, n_head=heads))

        def training_step(self, batch, batch_idx):
            ids, labels = batch
            logits = self.net(input_ids=ids).logits
            return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_start(self, *a) -> None:
            self.t0 = now()

        def on_train_batch_end(self, *a) -> None:
            self.times.append(now() - self.t0)

    def now() -> float:
        # On a GPU the step is queued work: read the clock once the device has finished it.
        if args.accelerator == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    torch.set_num_threads(args.threads)
    pl.seed_everything(0, verbose=False)
    strategy: object = args.strategy
    if args.strategy == "shardkit":
        from shardkit.lightning import ShardkitStrategy
        from shardkit.wrap import transformer_layers
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        strategy = ShardkitStrategy(auto_wrap_policy=transformer_layers({GPT2Block}))
    elif args.strategy == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        strategy = FSDPStrategy(auto_wrap_policy={GPT2Block})  # the same units as shardkit's
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (args.batch * args.devices * (args.steps + 2), args.seq + 1),
                        generator=gen)
    clock = Clock()
    trainer = pl.Trainer(accelerator=args.accelerator, devices=args.devices, strategy=strategy,
                         max_steps=args.steps + 2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[clock])
    trainer.fit(LM(), DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=args.batch))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    device_peak = torch.cuda.max_memory_allocated() if args.accelerator == "cuda" else 0
    with open(f"{args.out}.rank{trainer.global_rank}", "w") as f:
        json.dump({"times": clock.times[2:], "rss": rss, "device_peak": device_peak}, f)


def _run(strategy: str, args: argparse.Namespace, tmp: str) -> dict:
    out = os.path.join(tmp, strategy)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--strategy", strategy,
           "--out", out, "--model", args.model, "--devices", str(args.devices), "--batch",
           str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps), "--threads",
           str(args.threads), "--accelerator", args.accelerator]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{strategy} failed:\n{proc.stderr[-3000:]}")
    ranks = [json.load(open(f"{out}.rank{r}")) for r in range(args.devices)]
    per_step = [max(r["times"][i] for r in ranks) for i in range(len(ranks[0]["times"]))]
    return {"sec_per_step": statistics.median(per_step),
            "rss_mb": [r["rss"] / 2**20 for r in ranks],
            "device_mb": [r["device_peak"] / 2**20 for r in ranks]}


def main() -> None:
    """Run each strategy as a Lightning job and print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=tuple(SHAPES), default="gpt2-small")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=6, help="timed steps (after 2 untimed)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--strategies", default="ddp,shardkit")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--strategy", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        rows = {s: _run(s, args, tmp) for s in args.strategies.split(",")}
    base = rows.get("ddp")
    print(f"\n{args.model}, {args.devices} ranks on {args.accelerator}, batch {args.batch}/rank x "
          f"{args.seq} tokens, AdamW, {args.threads} thread(s)/rank, torch {torch.__version__}\n")
    print("| strategy | s/step (median) | vs DDP | peak RSS/rank (MB) | vs DDP | peak device/rank (MB) |\n"
          "|---|---|---|---|---|---|")
    for name, r in rows.items():
        time_ratio = f"{r['sec_per_step'] / base['sec_per_step']:.3f}" if base else "-"
        mem_ratio = f"{max(r['rss_mb']) / max(base['rss_mb']):.3f}" if base else "-"
        device = " / ".join(f"{m:.0f}" for m in r["device_mb"]) if args.accelerator == "cuda" else "-"
        print(f"| {name} | {r['sec_per_step']:.3f} | {time_ratio} | "
              f"{' / '.join(f'{m:.0f}' for m in r['rss_mb'])} | {mem_ratio} | {device} |")


if __name__ == "__main__":
    main()
