"""Handwritten digits that ship with scikit-learn, upscaled to MNIST's 28x28 and split per rank."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import ShardkitError
from ..install_hint import pip_install_extra

IMAGE_SIZE = 28
TEST_FRACTION = 0.2
SPLIT_SEED = 0


@dataclass
class Digits:
    """Normalised 1x28x28 images and integer labels for one split."""

    images: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        """Number of samples."""
        return int(self.labels.numel())


def require_scikit_learn() -> None:
    """Raise the install hint now, before any rank starts, when scikit-learn is missing."""
    try:
        import sklearn.datasets  # noqa: F401
    except ImportError as exc:
        raise ShardkitError("the demo trains on scikit-learn's bundled digits, but scikit-learn is "
                            f"not installed. HINT: {pip_install_extra('examples')}") from exc


def _load_raw() -> tuple[torch.Tensor, torch.Tensor]:
    require_scikit_learn()
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return images, torch.tensor(digits.target, dtype=torch.long)


def _split_indices(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stratified, seed-fixed split so every run and every rank sees the same test set."""
    gen = torch.Generator().manual_seed(SPLIT_SEED)
    train, test = [], []
    for cls in labels.unique(sorted=True).tolist():
        idx = (labels == cls).nonzero().flatten()
        idx = idx[torch.randperm(idx.numel(), generator=gen)]
        n_test = round(idx.numel() * TEST_FRACTION)
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    return torch.cat(train).sort().values, torch.cat(test).sort().values


def load_digits_28(limit_train: int | None = None) -> tuple[Digits, Digits]:
    """Return (train, test): digits upscaled 8x8 -> 28x28 bilinearly, normalised with train statistics."""
    images, labels = _load_raw()
    images = F.interpolate(images, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear",
                           align_corners=False)
    train_idx, test_idx = _split_indices(labels)
    if limit_train is not None:
        train_idx = train_idx[:limit_train]
    mean, std = images[train_idx].mean(), images[train_idx].std()
    images = (images - mean) / std
    return (Digits(images[train_idx], labels[train_idx]),
            Digits(images[test_idx], labels[test_idx]))


def rank_indices(n: int, rank: int, world_size: int, epoch: int, seed: int) -> torch.Tensor:
    """This rank's sample order for one epoch: a shared shuffle, padded so all ranks take equal steps."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
    per_rank = -(-n // world_size)
    # Ranks must run the same number of steps or the collectives deadlock, so wrap around.
    order = torch.cat([order, order[: per_rank * world_size - n]])
    return order[rank::world_size]


def rank_slice(n: int, rank: int, world_size: int) -> slice:
    """A contiguous, disjoint slice of n items for this rank (used to split evaluation)."""
    per_rank = -(-n // world_size)
    return slice(min(n, rank * per_rank), min(n, (rank + 1) * per_rank))


def batches(data: Digits, indices: torch.Tensor, batch_size: int):
    """Yield (images, labels) mini-batches in the given order; the last one may be short."""
    for start in range(0, indices.numel(), batch_size):
        idx = indices[start:start + batch_size]
        yield data.images[idx], data.labels[idx]
