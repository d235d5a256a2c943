"""The seed tutorial's MNIST CNNs, built from code: ShallowNet (~1.2M params) and DeepNet (~94M)."""

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


MODELS = {"shallow": ShallowNet, "deep": DeepNet, "mlp": MLP}


def build_model(name: str) -> nn.Module:
    """Construct one of MODELS by its short name."""
    try:
        return MODELS[name]()
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}") from None


def count_params(model: nn.Module) -> int:
    """Number of elements in the model's parameters."""
    return sum(p.numel() for p in model.parameters())
