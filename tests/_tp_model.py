"""A tiny Llama-style model and torchtitan's tensor-parallel plan for it (built from a config, no download).

The plan is torchtitan's `apply_tp` for Llama: the embedding rowwise with sequence-sharded output,
SequenceParallel norms, attention and feed-forward inputs prepared from sequence shards,
wq/wk/wv and w1/w3 colwise, wo and w2 rowwise back to sequence shards, the output projection
colwise with its logits left sharded for `loss_parallel`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from _planner_models import RMSNorm

DIM, HEADS, VOCAB, SEQ, LAYERS, HIDDEN = 32, 4, 64, 8, 2, 64


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wv = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seq, _ = x.shape
        head_dim = DIM // HEADS
        # -1 heads: under tensor parallelism each rank holds HEADS / tp of them.
        q, k, v = (w(x).view(bs, seq, -1, head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = RMSNorm(DIM)
        self.feed_forward = FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class TinyLlama(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def tokens(step: int, rank: int, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of data-parallel rank `rank` at `step`: the same on every TP rank."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    seq = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


def apply_tp(model: TinyLlama, tp_mesh) -> TinyLlama:
    """torchtitan's Llama tensor-parallel plan on `tp_mesh`."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                  use_local_output=False),
    })
    for block in model.layers:
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),),
                                            desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })
    return model


def tp_loss(logits, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over vocabulary-sharded logits (loss_parallel), as torchtitan computes it."""
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
