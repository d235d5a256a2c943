"""shardkit.plan(): hand-computed layouts, bytes and memory; bad input; 7B shapes on meta; the CLI.

The multi-process checks against measurement are in test_planner_measured.py.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import shardkit
from shardkit.cli.main import main
from shardkit.install_hint import pip_install_extra
from shardkit.sharding.step.layout import shard_layout

from _planner_models import LLAMA2_7B, LLAMA2_7B_PARAMS, LlamaShapedLayer, llama2_7b_shape

BF16 = shardkit.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
HERE = os.path.dirname(os.path.abspath(__file__))


def linear() -> nn.Module:
    """One Linear(3, 5): weight 15 elements, bias 5."""
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(3, 5))


def two_linears() -> nn.Module:
    """A parameterless root around Linear(3, 5) (20 params) and Linear(5, 2) (12 params)."""
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))


def per_linear():
    """Every nn.Linear is a unit."""
    return shardkit.wrap.transformer_layers({nn.Linear})


def comm(plan) -> tuple:
    """(all_gather, reduce_scatter, all_reduce, calls) of a plan."""
    c = plan.comm
    return c["all_gather"], c["reduce_scatter"], c["all_reduce"], c["calls"]


@pytest.mark.parametrize("numel, group, align, expected", [
    (10, 4, 1, (12, 3)), (12, 4, 1, (12, 3)), (0, 3, 1, (3, 1)), (1, 1, 1, (1, 1)),
    (8, 2, 128, (256, 128)), (256, 2, 128, (256, 128)), (257, 2, 128, (512, 256))])
def test_one_dim_layout_is_the_flat_layout(numel, group, align, expected):
    layout = shard_layout(numel, group, align)
    assert (layout.padded_numel, layout.shard_numel) == expected
    assert layout.shard_shape == (layout.shard_numel,)


@pytest.mark.parametrize("shape, group, align, shard_shape, padded", [
    ((32, 16), 3, 1, (11, 16), 3 * 176),      # whole rows: 11 of them, not 171 elements
    ((32, 16), 2, 1, (16, 16), 512),          # divides: no padding
    ((4, 3, 2), 8, 1, (1, 3, 2), 48),         # fewer rows than ranks: one padding row each
    ((0, 5), 2, 1, (1, 5), 10),               # empty: still one row per rank
    ((), 4, 128, (), 4),                      # 0-d stays 0-d, one element per rank, no alignment
    ((10, 64), 2, 128, (6, 64), 768),         # 5 rows -> 6: 64 extra elements < 128 aligns
    ((10, 3), 2, 128, (5, 3), 30),            # aligning would add 369 elements: left unaligned
    ((768, 3072), 8, 128, (96, 3072), 768 * 3072)])
def test_row_layout_keeps_dimensions_and_pads_whole_rows(shape, group, align, shard_shape, padded):
    layout = shard_layout(shape, group, align)
    assert layout.shard_shape == shard_shape
    assert layout.padded_numel == padded == group * layout.shard_numel
    assert layout.shard_numel == math.prod(shard_shape)


def test_full_shard_bytes_and_memory_by_hand():
    p = shardkit.plan(linear(), world_size=2)
    # weight (5, 3): 3 whole rows per rank -> shard (3, 3) = 9, padded 18; bias 5 -> 3 per
    # rank, padded 6: 12 fp32 elements per rank
    assert [(u.name, u.params, u.padded_numel, u.shard_numel) for u in p.units] == \
        [("<root>", 20, 24, 12)]
    assert p.persistent == {"params": 48, "grads": 48, "optimizer": 96, "total": 192}
    assert (p.persistent_device, p.persistent_host) == (192, 0)
    # gathered once (the root, here the whole model, keeps its parameters from forward to
    # backward) and reduce-scattered once, (2-1) shards each; freed after forward, gathered twice
    assert comm(p) == (48, 48, 0, {"all_gather": 1, "reduce_scatter": 1})
    freed = shardkit.plan(linear(), world_size=2, reshard_after_forward=True)
    assert comm(freed) == (96, 48, 0, {"all_gather": 2, "reduce_scatter": 1})
    assert p.comm["total"] == 96 and freed.comm["total"] == 144
    assert p.units[0].unsharded_bytes == 24 * 4 and p.units[0].grad_bytes == 20 * 4


def test_mixed_precision_gathers_in_param_dtype_and_reduces_in_reduce_dtype():
    p = shardkit.plan(linear(), world_size=2, mixed_precision=BF16)
    assert comm(p) == (12 * 2, 12 * 4, 0, {"all_gather": 1, "reduce_scatter": 1})
    assert p.units[0].unsharded_bytes == 24 * 2
    assert p.persistent["total"] == 192  # the shards stay fp32 masters


def test_each_strategy_by_hand():
    sgo = shardkit.plan(linear(), world_size=2, strategy="SHARD_GRAD_OP")
    assert comm(sgo) == (48, 48, 0, {"all_gather": 1, "reduce_scatter": 1})
    # NO_SHARD: shard group of one (nothing sent), the whole 20-element grad all-reduced by 4
    ns = shardkit.plan(linear(), world_size=4, strategy="NO_SHARD")
    assert comm(ns) == (0, 0, 120, {"all_reduce": 1})  # 2 * 3/4 * 80 bytes
    assert ns.persistent["total"] == 20 * 4 * 4
    # HYBRID 4 = 2 x 2: shard in pairs (12 elements each), all-reduce the shard across pairs
    hy = shardkit.plan(linear(), world_size=4, strategy="HYBRID_SHARD", hybrid_group_size=2)
    assert (hy.shard_group_size, hy.replica_group_size) == (2, 2)
    assert comm(hy) == (48, 48, 48, {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 1})
    # one rank: nothing is sent and nothing counted
    one = shardkit.plan(linear(), world_size=1)
    assert comm(one) == (0, 0, 0, {}) and one.persistent["total"] == 20 * 16


def test_frozen_params_are_gathered_but_not_reduced():
    model = linear()
    model[0].bias.requires_grad_(False)
    p = shardkit.plan(model, world_size=2)
    assert comm(p) == (48, 9 * 4, 0, {"all_gather": 1, "reduce_scatter": 1})
    assert p.persistent == {"params": 48, "grads": 36, "optimizer": 72, "total": 156}
    assert p.trainable_count == 15


def test_reshard_after_forward_int_gathers_backward_inside_k_ranks():
    # 4 ranks: weight (5, 3) -> 2 rows per rank (shard 6, padded 24), bias 5 -> 8 (shard 2):
    # 8 fp32 per rank
    p = shardkit.plan(linear(), world_size=4, reshard_after_forward=2)
    assert p.units[0].reshard_after_forward == 2
    forward = 3 * 8 * 4
    backward = (2 - 1) * (24 // 2 + 8 // 2) * 4  # (k-1) x the 1/k slices each rank keeps
    assert comm(p) == (forward + backward, 3 * 8 * 4, 0, {"all_gather": 2, "reduce_scatter": 1})
    # k == group is True, k == 1 is False
    assert shardkit.plan(linear(), world_size=4, reshard_after_forward=4).comm == \
        shardkit.plan(linear(), world_size=4, reshard_after_forward=True).comm
    assert shardkit.plan(linear(), world_size=4, reshard_after_forward=1).comm == \
        shardkit.plan(linear(), world_size=4, strategy="SHARD_GRAD_OP").comm
    per_unit = shardkit.plan(two_linears(), world_size=4, auto_wrap_policy=per_linear(),
                             reshard_after_forward={"0": False})
    # the root (last) keeps its parameters for backward unless told otherwise
    assert [u.reshard_after_forward for u in per_unit.units] == [False, True, False]


def test_alignment_from_argument_or_backend():
    p = shardkit.plan(linear(), world_size=2, shard_alignment=4)
    # weight: 3 rows of 3 -> 4 rows (12 elements); bias: 3 -> 4 elements
    assert p.units[0].padded_numel == 24 + 8 and p.units[0].shard_numel == 16
    assert shardkit.plan(linear(), world_size=2, backend="cpu").shard_alignment == \
        shardkit.get_backend("cpu").capabilities.shard_alignment


def test_peak_estimate_by_hand():
    # units "0" (padded 24 -> 96 B gathered, 80 B grads) and "1" (12 -> 48 B, 48 B); empty root
    base = dict(world_size=2, auto_wrap_policy=per_linear())
    p = shardkit.plan(two_linears(), **base)
    assert [u.name for u in p.units] == ["0", "1", "<root>"]
    assert p.persistent["total"] == (12 + 6) * 4 * 4 == 288
    assert (p.largest_unit, p.largest_unit_bytes) == ("0", 96)
    assert p.peak_bytes == 288 + (96 + 80) + (48 + 48)  # the unit computing + one prefetched
    assert shardkit.plan(two_linears(), prefetch=0, **base).peak_bytes == 288 + 96 + 80
    sgo = shardkit.plan(two_linears(), prefetch=0, strategy="SHARD_GRAD_OP", **base)
    assert sgo.peak_bytes == 288 + 96 + 80 + 48  # unit 1 stays gathered until its backward
    off = shardkit.plan(two_linears(), prefetch=0, cpu_offload=True, **base)
    assert (off.persistent_device, off.persistent_host, off.peak_bytes) == (0, 288, 96 + 80)


def test_meta_and_real_models_plan_the_same_and_tied_weights_count_once():
    torch.manual_seed(0)
    real = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
    assert shardkit.plan(real, world_size=3).to_dict() == \
        shardkit.plan(two_linears(), world_size=3).to_dict()
    with torch.device("meta"):
        tied = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    tied[1].weight = tied[0].weight
    assert shardkit.plan(tied, world_size=2).param_count == 16 + 4 + 4


def test_table_and_json_forms():
    p = shardkit.plan(two_linears(), world_size=2, auto_wrap_policy=per_linear(),
                      mixed_precision=BF16)
    d = json.loads(json.dumps(p.to_dict()))
    assert d["comm"] == p.comm and len(d["units"]) == 3 and d["param_dtype"] == "bfloat16"
    text = p.table()
    for needle in ("<root>", "persistent per rank", "estimated peak", "activations not included",
                   "all_gather", "reduce_scatter"):
        assert needle in text


@pytest.mark.parametrize("kwargs, message", [
    ({"world_size": 0}, "world_size must be a positive int"),
    ({"world_size": "2"}, "world_size must be a positive int"),
    ({"world_size": 4, "strategy": "HYBRID_SHARD", "hybrid_group_size": 3},
     "multiple of the shard group size (3)"),
    ({"world_size": 4, "reshard_after_forward": 3}, "use one of [1, 2, 4]"),
    ({"world_size": 4, "reshard_after_forward": 2.0}, "must be None, True, False or an int"),
    ({"world_size": 2, "reshard_after_forward": {"nope": 2}}, "unit(s) ['nope'] that do not exist"),
    ({"world_size": 2, "optimizer": "lion"}, "choose one of adadelta, adam, adamw, sgd"),
    ({"world_size": 2, "strategy": "zero4"}, "unknown sharding strategy"),
    ({"world_size": 2, "mixed_precision": torch.bfloat16}, "must be a shardkit.MixedPrecision"),
    ({"world_size": 2, "prefetch": -1}, "prefetch must be an int >= 0"),
    ({"world_size": 2, "shard_alignment": 4, "backend": "cpu"}, "not both"),
])
def test_bad_input_says_what_to_do(kwargs, message):
    with pytest.raises(shardkit.ShardkitError) as info:
        shardkit.plan(linear(), **kwargs)
    assert message in str(info.value)


def test_not_a_module_or_no_parameters():
    with pytest.raises(shardkit.ShardkitError, match="needs an nn.Module"):
        shardkit.plan("model", world_size=2)
    with pytest.raises(shardkit.ShardkitError, match="no parameters"):
        shardkit.plan(nn.ReLU(), world_size=2)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _plan_7b(model: nn.Module, layer: type) -> shardkit.Plan:
    return shardkit.plan(model, world_size=8, auto_wrap_policy=shardkit.wrap.transformer_layers(
        {layer}), mixed_precision=BF16)


def _check_7b(p: shardkit.Plan) -> None:
    assert p.param_count == LLAMA2_7B_PARAMS
    assert len(p.units) == LLAMA2_7B["layers"] + 1
    # FULL_SHARD: all-gather twice in bf16 (the root once: it keeps its parameters for
    # backward) and reduce-scatter once in fp32, 7/8 of the padded model each (every size here
    # divides by 8, so nothing is padded)
    assert sum(u.padded_numel for u in p.units) == LLAMA2_7B_PARAMS
    root = p.units[-1].padded_numel
    assert p.comm["all_gather"] == 7 * 2 * (2 * LLAMA2_7B_PARAMS - root) // 8
    assert p.comm["reduce_scatter"] == 7 * 4 * LLAMA2_7B_PARAMS // 8
    assert p.persistent["total"] == 16 * LLAMA2_7B_PARAMS // 8


def test_7b_shape_plans_on_meta_without_memory():
    before = _rss()
    with torch.device("meta"):
        model = llama2_7b_shape()
    p = _plan_7b(model, LlamaShapedLayer)
    assert _rss() - before < 100 * 2**20
    _check_7b(p)


def test_llama2_7b_from_transformers_config():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008,
                                      num_hidden_layers=32, num_attention_heads=32,
                                      num_key_value_heads=32, vocab_size=32000,
                                      tie_word_embeddings=False)
    before = _rss()
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    p = _plan_7b(model, type(model.model.layers[0]))
    assert _rss() - before < 100 * 2**20
    _check_7b(p)


def test_cli_factory_json_equals_the_api(capsys, monkeypatch):
    monkeypatch.chdir(HERE)
    assert main(["plan", "_planner_models:llama2_7b_shape", "--world-size", "8",
                 "--mixed-precision", "bf16", "--wrap", "LlamaShapedLayer", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    with torch.device("meta"):
        model = llama2_7b_shape()
    assert got == json.loads(json.dumps(_plan_7b(model, LlamaShapedLayer).to_dict()))


def test_cli_bad_input(capsys, monkeypatch):
    monkeypatch.chdir(HERE)
    assert main(["plan", "_planner_models:nothing", "--world-size", "2"]) == 1
    assert "has no attribute 'nothing'" in capsys.readouterr().err
    assert main(["plan", "_planner_models:llama2_7b_shape", "--world-size", "2",
                 "--wrap", "Block"]) == 1
    assert "its module classes are" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    assert main(["plan", "--hf-config", "gpt2", "--world-size", "2"]) == 1
    assert f"HINT: {pip_install_extra('hf')}" in capsys.readouterr().err


def test_cli_hf_config_name_overrides_and_json_file(capsys, tmp_path):
    pytest.importorskip("transformers")
    args = ["--set", "n_layer=3", "--set", "n_embd=64", "--set", "n_head=4", "--world-size", "2",
            "--json"]
    assert main(["plan", "--hf-config", "gpt2", *args]) == 0
    by_name = json.loads(capsys.readouterr().out)
    # GPT-2: tied wte/lm_head counted once; one unit per GPT2Block (its _no_split_modules)
    wte, wpe, block = 50257 * 64, 1024 * 64, 12 * 64 * 64 + 13 * 64
    assert by_name["param_count"] == wte + wpe + 3 * block + 2 * 64
    assert [u["name"] for u in by_name["units"]] == [f"transformer.h.{i}" for i in range(3)] + \
        ["<root>"]
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "n_layer": 3, "n_embd": 64, "n_head": 4}))
    assert main(["plan", "--hf-config", str(config), "--world-size", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == by_name
    assert main(["plan", "--hf-config", "gpt2", "--set", "n_layers=3", "--world-size", "2"]) == 1
    assert "has no setting 'n_layers'" in capsys.readouterr().err


def test_cli_runs_as_a_command():
    proc = subprocess.run([sys.executable, "-m", "shardkit", "plan",
                           "_planner_models:llama2_7b_shape", "--world-size", "8",
                           "--strategy", "hybrid_shard", "--hybrid-group-size", "4",
                           "--wrap", "LlamaShapedLayer", "--reshard-after-forward", "2"],
                          cwd=HERE, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "6,738,415,616 params" in proc.stdout and "HYBRID_SHARD on 8 rank(s)" in proc.stdout
    assert "layers.0..layers.31 (x32)" in proc.stdout
