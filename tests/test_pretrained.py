"""Hugging Face save/load as users call it, on a sharded model (issue 54)."""

from __future__ import annotations

import json
import os

import pytest
import torch

import shardkit
from _pretrained_workers import one_rank_saves, save_as_users_do, tiny_gpt2

transformers = pytest.importorskip("transformers")


@pytest.mark.slow
@pytest.mark.long  # two spawned jobs with a GPT-2: about 17 s on 2 cores
@pytest.mark.parametrize("world", [2, 3])
def test_save_pretrained_is_refused_at_once_and_export_is_what_from_pretrained_reads(tmp_path, world):
    results = shardkit.spawn(save_as_users_do, world, str(tmp_path), threads_per_rank=1)
    # rank 0 alone calling save_pretrained used to hang in transformers' tied-weights check
    # until the collective timeout; now it is refused before anything is written.
    habit = results[0]["habit"]
    assert habit.startswith("save_pretrained() of a model sharded by shardkit"), habit
    assert "shardkit.checkpoint.export(dir, model) on every rank" in habit
    assert results[0]["habit_s"] < 1.0 and not (tmp_path / "habit").exists()
    exported = tmp_path / "exported"
    names = sorted(os.listdir(exported))
    assert "config.json" in names and "model.safetensors.index.json" in names, names
    assert sum(n.endswith(".safetensors") for n in names) >= 3, names  # split at 100 KB
    loaded = transformers.GPT2LMHeadModel.from_pretrained(exported)  # no further step
    full = torch.load(tmp_path / "full.pt")
    reference = tiny_gpt2()
    reference.load_state_dict(full)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # tied
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        diff = (loaded(input_ids=ids).logits - reference(input_ids=ids).logits).abs().max().item()
    assert diff == 0.0, diff
    index = json.loads((exported / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(full)


def test_save_pretrained_of_a_world_of_one_is_hugging_faces_own(tmp_path):
    # One rank holds whole plain parameters: nothing to refuse.
    (names,) = shardkit.spawn(one_rank_saves, 1, str(tmp_path / "one"), threads_per_rank=1)
    assert "config.json" in names and "model.safetensors" in names, names
