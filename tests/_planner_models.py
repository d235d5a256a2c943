"""Model shapes for the planner tests, importable as `module:factory` targets of `shardkit plan`."""

from __future__ import annotations

import torch
from torch import nn

LLAMA2_7B = {"layers": 32, "hidden": 4096, "intermediate": 11008, "vocab": 32000}
LLAMA2_7B_PARAMS = 6_738_415_616  # Llama-2-7B, untied embeddings


class RMSNorm(nn.Module):
    """A scale-only norm (one weight vector), as in Llama."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x / rms(x) * weight."""
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class LlamaShapedLayer(nn.Module):
    """The parameters of one Llama decoder layer (attention q/k/v/o, gated MLP, two norms)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.input_norm = RMSNorm(hidden)
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden, bias=False) for _ in range(4))
        self.post_norm = RMSNorm(hidden)
        self.gate = nn.Linear(hidden, intermediate, bias=False)
        self.up = nn.Linear(hidden, intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Single-head causal attention and the gated MLP, with residuals."""
        h = self.input_norm(x)
        att = torch.nn.functional.scaled_dot_product_attention(self.q(h), self.k(h), self.v(h),
                                                               is_causal=True)
        x = x + self.o(att)
        h = self.post_norm(x)
        return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


class LlamaShaped(nn.Module):
    """Embedding, decoder layers, final norm and an untied LM head, sized like Llama."""

    def __init__(self, layers: int, hidden: int, intermediate: int, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(LlamaShapedLayer(hidden, intermediate) for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (batch, seq) -> logits (batch, seq, vocab)."""
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def llama2_7b_shape() -> LlamaShaped:
    """Llama-2-7B's parameter shapes (build it under torch.device("meta"))."""
    return LlamaShaped(**LLAMA2_7B)


def tiny_lm() -> nn.Module:
    """A two-layer Llama-shaped model that returns plain logits (no loss of its own)."""
    return LlamaShaped(layers=2, hidden=64, intermediate=128, vocab=500)
