"""The model and data of the fault-tolerance tests: batches depend only on (step, group, rank)."""

from __future__ import annotations

import torch
from torch import nn

BATCH = 8  # samples per rank per step


class Net(nn.Module):
    """Three linear layers (each a unit for FSDP2's fully_shard), a regression head."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(3)])
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def build_model(width: int) -> Net:
    """The model every group builds (the caller seeds torch first)."""
    return Net(width)


def batch(step: int, group: int, rank: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch rank `rank` of replica group `group` trains on at `step` (a generator of its own:
    torch's global RNG is left alone)."""
    gen = torch.Generator().manual_seed(1_000_003 * step + 1009 * group + rank)
    x = torch.randn(BATCH, width, generator=gen)
    y = torch.stack([x[:, :4].sum(1), x[:, 4:8].prod(1), x[:, 8].sin(), x[:, 9:12].mean(1)], 1)
    return x, y
