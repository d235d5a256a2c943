"""The PyTorch FSDP T5 tutorial's features on a small transformer built from a config (no download).

Like the tutorial: one sharding unit per transformer layer (`shardkit.wrap.transformer_layers`),
bf16 mixed precision when the backend supports it (the tutorial's `bf16_ready`, here
`backend.supports_dtype(torch.bfloat16)`), prefetching the next layer's parameters, a
--strategy flag (FULL_SHARD or SHARD_GRAD_OP), AdamW + StepLR, per-epoch validation and memory
figures, and the best model saved as a full state dict gathered to rank 0's CPU. The task is
synthetic: continue arithmetic sequences (x, x+k, x+2k, ... mod vocab) with k hidden in the prefix.

    python examples/transformer_fsdp.py --nproc 2 --epochs 3
    shardkit launch --nproc 2 examples/transformer_fsdp.py --strategy SHARD_GRAD_OP --save best.pt
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.lr_scheduler import StepLR

import shardkit
from shardkit.checkpoint import full_state_dict

from launching import add_launch_args, run  # examples/launching.py


@dataclass(frozen=True)
class TransformerConfig:
    """Model size; the defaults train in seconds on a CPU."""

    vocab_size: int = 32
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 3
    d_ff: int = 256
    max_len: int = 32


class TransformerLayer(nn.Module):
    """A pre-norm decoder layer: causal self-attention and an MLP (the unit the policy wraps)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.ff = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_ff), nn.GELU(),
                                nn.Linear(cfg.d_ff, cfg.d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend to earlier positions, then transform each position."""
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        heads = [z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v)]
        attn = F.scaled_dot_product_attention(*heads, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.ff(self.ln2(x))


class TinyTransformerLM(nn.Module):
    """Token + position embeddings, a stack of TransformerLayer, and a language-model head."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_len, cfg.d_model)
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token logits for every position."""
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln_f(x))


def sequences(n: int, cfg: TransformerConfig, seed: int) -> torch.Tensor:
    """n arithmetic sequences mod vocab_size: a random start and a step k in 1..4."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, cfg.vocab_size, (n, 1), generator=g)
    step = torch.randint(1, 5, (n, 1), generator=g)
    return (start + step * torch.arange(cfg.max_len)) % cfg.vocab_size


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy, skipping the first prediction (k is unknown until two tokens)."""
    logits = model(tokens[:, :-1]).float()
    return F.cross_entropy(logits[:, 1:].reshape(-1, logits.shape[-1]), tokens[:, 2:].reshape(-1))


def all_sum(ctx, values: list[float]) -> list[float]:
    """Sum floats over every rank (the engine's collectives take only "sum")."""
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    ctx.backend.all_reduce(t, ctx.world, op="sum").wait()
    return t.tolist()


def train(args, model, ctx, optimizer, epoch, cfg) -> float:
    """One epoch of --steps-per-epoch steps on fresh, rank-specific batches; returns the mean loss."""
    model.train()
    total = 0.0
    for step in range(args.steps_per_epoch):
        seed = args.seed + 1_000_003 * epoch + 1009 * step + ctx.rank
        tokens = sequences(args.batch_size, cfg, seed).to(ctx.device)
        optimizer.zero_grad()
        loss = lm_loss(model, tokens)
        loss.backward()
        optimizer.step()
        ctx.backend.step_boundary()
        total += loss.item()
    loss_sum, count = all_sum(ctx, [total, args.steps_per_epoch])
    return loss_sum / count


@torch.no_grad()
def validation(model, ctx, cfg, val_tokens: torch.Tensor) -> float:
    """Mean loss over the fixed validation set, each rank scoring its own slice."""
    model.eval()
    per_rank = -(-len(val_tokens) // ctx.world_size)
    mine = val_tokens[ctx.rank * per_rank:(ctx.rank + 1) * per_rank].to(ctx.device)
    loss = lm_loss(model, mine).item() * len(mine) if len(mine) else 0.0
    loss_sum, count = all_sum(ctx, [loss, len(mine)])
    return loss_sum / count


def mixed_precision_policy(args, backend):
    """The tutorial's bfSixteen policy when bf16 is asked for, or 'auto' and the backend supports it."""
    wanted = args.mixed_precision
    bf16_ready = backend.supports_dtype(torch.bfloat16)
    if wanted == "bf16" and not bf16_ready:
        raise shardkit.ShardkitError(f"backend {backend.name!r} does not support bf16; "
                                     "HINT: run with --mixed-precision fp32")
    if wanted == "fp32" or not bf16_ready:
        return None
    return shardkit.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                   buffer_dtype=torch.bfloat16)


def fsdp_main(rank, args):
    """One rank: build, shard, train, validate, and keep the best full checkpoint."""
    ctx = shardkit.current_context()
    cfg = TransformerConfig(n_layers=args.layers, d_model=args.d_model)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = TinyTransformerLM(cfg)
    mp_policy = mixed_precision_policy(args, ctx.backend)
    model = shardkit.shard(model,
                           strategy=args.strategy,
                           auto_wrap_policy=shardkit.wrap.transformer_layers({TransformerLayer}),
                           mixed_precision=mp_policy,
                           prefetch=args.prefetch)
    if ctx.rank == 0:
        print(f"backend {ctx.backend.name}, {ctx.world_size} rank(s), strategy {args.strategy}, "
              f"mixed precision {'bf16' if mp_policy else 'fp32'}, prefetch {args.prefetch}",
              flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    val_tokens = sequences(args.val_size, cfg, seed=12345)
    best_val_loss = float("inf")
    for epoch in range(1, args.epochs + 1):
        t0 = time.perf_counter()
        train_loss = train(args, model, ctx, optimizer, epoch, cfg)
        val_loss = validation(model, ctx, cfg, val_tokens)
        scheduler.step()
        mem = ctx.backend.memory_stats(ctx.device)
        # On the host the figures are the process's resident memory (all of Python and torch);
        # on an accelerator, the tensors torch's allocator holds on the device.
        what = "resident" if ctx.device.type == "cpu" else "allocated"
        if ctx.rank == 0:
            print(f"Epoch {epoch}: train loss {train_loss:.4f}, validation loss {val_loss:.4f}, "
                  f"{time.perf_counter() - t0:.2f}s, memory {what} {mem['allocated'] / 2**20:.1f} "
                  f"MiB, peak {mem['peak'] / 2**20:.1f} MiB", flush=True)
        if args.save and val_loss < best_val_loss:
            # The tutorial's FULL_STATE_DICT with offload_to_cpu=True, rank0_only=True.
            cpu_state = full_state_dict(model, rank0_only=True, cpu_offload=True)
            if ctx.rank == 0:
                torch.save({"config": cfg.__dict__, "state": cpu_state, "epoch": epoch,
                            "val_loss": val_loss}, args.save)
                print(f"saved the full model (validation loss {val_loss:.4f}) to {args.save}",
                      flush=True)
        best_val_loss = min(best_val_loss, val_loss)
    ctx.barrier()


def parse_args(argv=None):
    """Tutorial-style options, sized so a CPU run takes seconds."""
    parser = argparse.ArgumentParser(description="shardkit FSDP transformer example")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-per-epoch", type=int, default=40)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--gamma", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--val-size", type=int, default=64)
    parser.add_argument("--strategy", default="FULL_SHARD", choices=["FULL_SHARD", "SHARD_GRAD_OP"])
    parser.add_argument("--mixed-precision", default="auto", choices=["auto", "bf16", "fp32"],
                        help="auto: bf16 when the backend supports it (the tutorial's bf16_ready)")
    parser.add_argument("--prefetch", type=int, default=1,
                        help="layers whose parameters are gathered ahead (0: none)")
    parser.add_argument("--save", default=None, metavar="PATH",
                        help="rank 0 saves the best model's full state dict here")
    add_launch_args(parser)
    return parser.parse_args(argv)


def main(argv=None):
    """Run as one rank under a launcher (shardkit launch, mpirun, SLURM), or spawn --nproc ranks."""
    run(fsdp_main, parse_args(argv))


if __name__ == "__main__":
    main()
