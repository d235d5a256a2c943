"""The model and data of the multi-node tests: small enough for 4 CPU ranks, shaped like a transformer stack."""

from __future__ import annotations

import torch
from torch import nn

DIM, BLOCKS, GLOBAL_BATCH = 96, 4, 16


class Block(nn.Module):
    """A residual block: one shardkit unit."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(torch.tanh(self.lin(x)))


def build(seed: int = 0) -> nn.Module:
    """The same weights in every process."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, DIM), *(Block(DIM) for _ in range(BLOCKS)), nn.Linear(DIM, 4))


def batch_for_step(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step` (every rank takes its slice)."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)
