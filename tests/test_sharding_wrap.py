"""Auto-wrap policies pick the expected units; tied parameters go to their common unit."""

from __future__ import annotations

import pytest
from torch import nn

import shardkit
from shardkit.sharding.setup.plan import plan_units
from shardkit.wrap import as_policy

from _models import Block, TinyNet


def _units(model, policy):
    return {u.name: sorted(f for p in u.params for f in p.fqns)
            for u in plan_units(model, as_policy(policy))}


def test_transformer_layers_policy_wraps_each_block_and_root_keeps_the_rest():
    units = _units(TinyNet(), shardkit.wrap.transformer_layers({Block}))
    assert list(units) == ["blocks.0", "blocks.1", ""]
    assert "blocks.0.qkv.weight" in units["blocks.0"]
    assert sorted(units[""]) == sorted(["conv.weight", "conv.bias", "embed.weight", "embed.bias",
                                        "norm.weight", "norm.bias", "head.weight", "head.bias"])


def test_module_list_policy_equals_blocks_here():
    assert _units(TinyNet(), shardkit.wrap.module_list()) == \
        _units(TinyNet(), shardkit.wrap.transformer_layers(Block))


def test_size_based_counts_only_unclaimed_params():
    model = TinyNet()
    block_numel = sum(p.numel() for p in model.blocks[0].parameters())
    units = _units(model, shardkit.wrap.size_based(block_numel))
    # Each block qualifies; the ModuleList then has nothing unclaimed, so it is not a unit.
    assert set(units) == {"blocks.0", "blocks.1", ""}
    fc1 = sum(p.numel() for p in model.blocks[0].fc1.parameters())
    units = _units(model, shardkit.wrap.size_based(fc1))
    assert "blocks.0.fc1" in units and "blocks.0" in units  # the block's remainder is big enough too


def test_any_callable_is_a_policy():
    units = _units(TinyNet(), lambda m: isinstance(m, nn.LayerNorm))
    assert {"blocks.0.ln1", "blocks.0.ln2", "blocks.1.ln1", "blocks.1.ln2", "norm", ""} == set(units)


def test_tied_parameter_across_units_belongs_to_their_common_unit():
    model = TinyNet()
    model.blocks[1].proj.weight = model.blocks[0].proj.weight
    units = _units(model, shardkit.wrap.transformer_layers({Block}))
    assert "blocks.0.proj.weight" in units[""] and "blocks.1.proj.weight" in units[""]
    assert "blocks.0.proj.weight" not in units["blocks.0"]


def test_bad_policies_are_rejected_clearly():
    with pytest.raises(shardkit.ShardkitError, match="positive int"):
        shardkit.wrap.size_based(0)
    with pytest.raises(shardkit.ShardkitError, match="nn.Module subclasses"):
        shardkit.wrap.transformer_layers({int})
    with pytest.raises(shardkit.ShardkitError, match="auto_wrap_policy"):
        as_policy(3)
