"""Full weights (Hugging Face's safetensors layout, split with an index) loaded into a
meta-initialised sharded model: each rank reads only its own rows of each tensor from the files
(counted against the row layout's formula), and the weights equal the saved ones exactly."""

from __future__ import annotations

import pytest
import torch

import shardkit
from shardkit.checkpoint.safetensors_io import SafetensorsLayout

from _load_rows_workers import Tall, load_rows


def _rows_of(rank: int, world: int, shape: tuple) -> int:
    """Elements of `shape` in rank `rank`'s rows (ceil(rows / world) per rank, the last short)."""
    if not shape:
        return 1  # a 0-d parameter: every rank holds (and reads) it whole
    per_rank = max(1, -(-shape[0] // world))
    rows = max(0, min(per_rank, shape[0] - rank * per_rank))
    return rows * int(torch.tensor(shape[1:]).prod().item() if len(shape) > 1 else 1)


@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_reads_only_its_rows_and_loads_the_saved_weights(world, tmp_path):
    torch.manual_seed(3)
    saved = {k: v.detach().clone() for k, v in Tall(vocab=1001).state_dict().items()}
    layout = SafetensorsLayout([(k, tuple(v.shape), v.dtype) for k, v in saved.items()], 20_000)
    layout.create(str(tmp_path))
    for name, tensor in saved.items():
        layout.write(str(tmp_path), name, tensor)
    layout.finish(str(tmp_path))
    assert len(layout.files) > 1  # split, with model.safetensors.index.json
    results = shardkit.spawn(load_rows, world, world, str(tmp_path), 1001, threads_per_rank=1)
    for rank, r in enumerate(results):
        assert r["read"] == {k: _rows_of(rank, world, tuple(v.shape)) for k, v in saved.items()}
        for name, tensor in saved.items():
            assert torch.equal(r["loaded"][name], tensor), name
    # Together the ranks read each tensor once (plus the 0-d scale on every rank), not world times.
    total = sum(sum(r["read"].values()) for r in results)
    assert total == sum(v.numel() for v in saved.values()) + (world - 1)
