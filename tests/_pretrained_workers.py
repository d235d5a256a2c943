"""Ranks of tests/test_pretrained.py: a sharded Hugging Face GPT-2 saved as users call it."""

from __future__ import annotations

import time

import torch

import shardkit


def tiny_gpt2():
    """A GPT-2 small enough to train in a test, with its tied embedding and LM head."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def save_as_users_do(rank: int, out_dir: str) -> dict:
    """Train 3 steps sharded; rank 0 alone tries save_pretrained; every rank exports."""
    model = tiny_gpt2()
    block = type(model.transformer.h[0])
    model = shardkit.shard(model, auto_wrap_policy=shardkit.wrap.transformer_layers({block}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(rank)
    for _ in range(3):
        ids = torch.randint(0, 128, (2, 16), generator=data)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    out: dict = {}
    if rank == 0:  # the Hugging Face habit: rank 0 alone
        began = time.monotonic()
        try:
            model.save_pretrained(out_dir + "/habit")
            out["habit"] = "saved"
        except shardkit.ShardkitError as exc:
            out["habit"] = str(exc)
        out["habit_s"] = time.monotonic() - began
    shardkit.checkpoint.export(out_dir + "/exported", model, max_shard_size="100KB")
    full = shardkit.checkpoint.full_state_dict(model)
    if rank == 0:
        torch.save(full, out_dir + "/full.pt")
    return out


def one_rank_saves(rank: int, out_dir: str) -> list[str]:
    """A world of one: Hugging Face's own save_pretrained on the sharded model."""
    import os

    model = shardkit.shard(tiny_gpt2())
    model.save_pretrained(out_dir)
    loaded = type(tiny_gpt2()).from_pretrained(out_dir)
    mine = shardkit.checkpoint.full_state_dict(model)
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, mine[name]), name
    return sorted(os.listdir(out_dir))
