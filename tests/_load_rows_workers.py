"""Per-rank worker: a Hugging Face style safetensors folder loaded into a meta-initialised sharded
model, noting how many elements of each tensor this rank read from the files."""

from __future__ import annotations

import resource

import torch
from torch import nn

import shardkit
import shardkit.checkpoint as ck
import shardkit.checkpoint.full as full_module


class Tall(nn.Module):
    """An embedding much larger than the rest (a language model's), a block and a 0-d scale."""

    def __init__(self, vocab: int = 1000, width: int = 24) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.block = nn.Sequential(nn.Linear(width, 2 * width + 1), nn.GELU(),
                                   nn.Linear(2 * width + 1, width))
        self.scale = nn.Parameter(torch.tensor(0.5))

    def reset_parameters(self) -> None:
        """The root's own parameter (meta initialisation calls this)."""
        with torch.no_grad():
            self.scale.fill_(0.5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: (batch, tokens) -> (batch, tokens, width)."""
        return self.block(self.embed(ids)) * self.scale


def load_rows(rank: int, world: int, folder: str, vocab: int) -> dict:
    """Meta init, shard, load the folder; the elements read per tensor, the loaded full tensors
    and this rank's peak RSS growth during the load (MiB)."""
    read_numel: dict[str, int] = {}
    opened = full_module.read_full_source

    def counting(source):
        shapes, read = opened(source)

        def read_counted(name, span):
            tensor = read(name, span)
            read_numel[name] = read_numel.get(name, 0) + tensor.numel()
            return tensor
        return shapes, read_counted

    with torch.device("meta"):
        model = Tall(vocab)
    model = shardkit.shard(model, auto_wrap_policy=lambda m: isinstance(m, nn.Sequential))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    full_module.read_full_source = counting
    try:
        ck.load_full_state_dict(model, folder)
    finally:
        full_module.read_full_source = opened
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    loaded = {n: shardkit.full_tensor(p).clone() for n, p in model.named_parameters()}
    return {"read": read_numel, "loaded": loaded, "grown_mib": grown_mib}
