"""Small models shared by the sharding tests (sizes chosen so shards are uneven for 2 and 3 ranks)."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """A pre-LayerNorm transformer block: single-head attention + MLP, residuals."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        # No bias on q/k/v: a key bias has a mathematically zero gradient under softmax, and Adam
        # turns that rounding noise into full-size steps, which no parity test could tolerate.
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim + 1)
        self.fc2 = nn.Linear(2 * dim + 1, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (batch, tokens, dim)."""
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(1, 2) / q.shape[-1] ** 0.5, dim=-1)
        x = x + self.proj(att @ v)
        return x + self.fc2(torch.relu(self.fc1(self.ln2(x))))


class TinyNet(nn.Module):
    """conv -> tokens -> linear -> transformer blocks -> mean pool -> linear head."""

    def __init__(self, dim: int = 14, blocks: int = 2, classes: int = 5) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3, padding=1)
        self.embed = nn.Linear(3, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (batch, 1, 4, 4) -> logits (batch, classes)."""
        h = torch.relu(self.conv(x)).flatten(2).transpose(1, 2)  # (batch, 16 tokens, 3)
        h = self.embed(h)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h).mean(dim=1))


def batch(step: int, rank: int, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic (inputs, labels) for one rank at one step."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(size, 1, 4, 4, generator=g), torch.randint(0, 5, (size,), generator=g)


def global_batch(step: int, world: int, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The concatenation of every rank's batch at one step (what the reference trains on)."""
    parts = [batch(step, r, size) for r in range(world)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


class TwiceNet(TinyNet):
    """TinyNet that applies its first block twice (a module called twice in one forward)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Same as TinyNet, with blocks[0] applied two times in a row."""
        h = self.embed(torch.relu(self.conv(x)).flatten(2).transpose(1, 2))
        h = self.blocks[0](self.blocks[0](h))
        h = self.blocks[1](h)
        return self.head(self.norm(h).mean(dim=1))
