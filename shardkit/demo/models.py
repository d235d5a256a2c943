"""Demo and benchmark models: the seed tutorial's MNIST CNNs (ShallowNet ~1.2M, DeepNet ~94M params),
an MLP, and a GPT-2-style decoder (GPT) for transformer benchmarks and tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import override


class ShallowNet(nn.Module):
    """conv 1-32, conv 32-64, maxpool, dropout, fc 9216-128-10 (1,199,882 params)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return class logits for a batch of 1x28x28 images."""
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        x = torch.flatten(self.dropout1(F.max_pool2d(x, 2)), 1)
        return self.fc2(self.dropout2(F.relu(self.fc1(x))))


class DeepNet(nn.Module):
    """conv 1-32-64, maxpool, fc 9216-9000-1000-1000-1000-128-10 (94,104,234 params)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.fc1 = nn.Linear(9216, 9000)
        self.fc2 = nn.Linear(9000, 1000)
        self.fc3 = nn.Linear(1000, 1000)
        self.fc4 = nn.Linear(1000, 1000)
        self.fc5 = nn.Linear(1000, 128)
        self.fc6 = nn.Linear(128, 10)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return class logits for a batch of 1x28x28 images."""
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = torch.flatten(x, 1)
        for fc in (self.fc1, self.fc2, self.fc3, self.fc4, self.fc5):
            x = F.relu(fc(x))
        return self.fc6(x)


class MLP(nn.Module):
    """784-2048-1024-1024-10 (4,765,706 params): the feasibility study's small benchmark model."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(784, 2048)
        self.fc2 = nn.Linear(2048, 1024)
        self.fc3 = nn.Linear(1024, 1024)
        self.fc4 = nn.Linear(1024, 10)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return class logits for a batch of 1x28x28 images."""
        x = torch.flatten(x, 1)
        x = F.relu(self.fc3(F.relu(self.fc2(F.relu(self.fc1(x))))))
        return self.fc4(x)


class GPTBlock(nn.Module):
    """Pre-norm decoder block: causal self-attention and a 4x GELU MLP, GPT-2's layout."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return the block's output for hidden states of shape (batch, tokens, dim)."""
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """GPT-2-style language model (tied input/output embedding); defaults are GPT-2 medium's shape."""

    def __init__(self, vocab: int = 50257, context: int = 1024, dim: int = 1024, layers: int = 24,
                 heads: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(GPTBlock(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)

    @override
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Return next-token logits of shape (batch, tokens, vocab) for token ids (batch, tokens)."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)


MODELS = {"shallow": ShallowNet, "deep": DeepNet, "mlp": MLP,
          "gpt2-medium": GPT, "gpt2-small": lambda: GPT(dim=768, layers=12, heads=12),
          "gpt-tiny": lambda: GPT(vocab=128, context=32, dim=32, layers=2, heads=4)}


def build_model(name: str) -> nn.Module:
    """Construct one of MODELS by its short name."""
    try:
        return MODELS[name]()
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}") from None


def count_params(model: nn.Module) -> int:
    """Number of elements in the model's parameters."""
    return sum(p.numel() for p in model.parameters())
