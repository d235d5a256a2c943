"""Quantized collectives (shardkit.Quantization, ZeRO++ qwZ / qgZ): the int8 block code, each
collective against the formula computed in one process, training beside the exact run, and the
bytes against the planner's."""

from __future__ import annotations

import pytest
import torch

import shardkit
from shardkit import Quantization, ShardkitError
from shardkit.sharding.policies import ShardConfig
from shardkit.sharding.step.quantize import decode_rows, encode_rows, payload_bytes

from _models import Block, TinyNet
from _quantize_workers import (BLOCK, ROW, collectives, gathered_weight, mixed_precision_training,
                               step_bytes, training)


# ---- the code itself ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("numel, block", [(1000, 256), (64, 64), (5, 8), (4097, 128)])
def test_each_value_is_within_half_an_int8_step_of_its_block(numel, block, dtype):
    gen = torch.Generator().manual_seed(numel)
    rows = (torch.randn(3, numel, generator=gen) * torch.logspace(-4, 2, numel)).to(dtype)
    rows[1, 0] = 1e4  # an outlier: only its own block loses resolution
    rows[2] = 0.0  # an all-zero row decodes to exact zeros (its scales are 0)
    decoded = decode_rows(encode_rows(rows, block), numel, block)
    blocks = -(-numel // block)
    padded = torch.nn.functional.pad(rows.float(), (0, blocks * block - numel)).view(3, blocks, block)
    step = padded.abs().amax(dim=2, keepdim=True) / 127  # the block's int8 step
    err = (torch.nn.functional.pad(decoded - rows.float(), (0, blocks * block - numel))
           .view(3, blocks, block)).abs()
    # Half a step of the block's own grid, plus fp32's rounding of the divide and multiply.
    assert bool((err <= step / 2 + padded.abs() * 2.5e-7).all())
    assert torch.equal(decoded[2], torch.zeros(numel))
    if blocks > 1:  # the outlier's block is coarse; the next keeps its own, finer step
        assert step[1, 0] > 100 * step[1, 1]


def test_payload_is_codes_then_one_fp32_scale_per_block():
    assert payload_bytes(1000, 256) == 4 * 256 + 4 * 4  # 1000 pads to 4 blocks
    assert payload_bytes(256, 256) == 256 + 4
    payload = encode_rows(torch.tensor([[1.0, -2.0, 0.5, 0.0]]), 4)
    assert payload.dtype == torch.uint8 and payload.shape == (1, 8)
    assert payload[0, :4].view(torch.int8).tolist() == [64, -127, 32, 0]  # round(x / (2 / 127))
    assert payload[0, 4:].view(torch.float32).item() == pytest.approx(2 / 127)


def test_the_code_runs_on_the_meta_device_for_the_planner():
    rows = torch.empty(4, 300, device="meta")
    assert decode_rows(encode_rows(rows, 64), 300, 64).shape == (4, 300)


@pytest.mark.parametrize("kwargs, words", [
    ({"block_size": 0}, "block_size must be an int in [8, 1048576]"),
    ({"block_size": 3.5}, "block_size must be an int"),
    ({"weights": "int8"}, "Quantization.weights must be True or False"),
])
def test_bad_quantization_options_say_what_is_allowed(kwargs, words):
    with pytest.raises(ShardkitError, match=words.replace("[", r"\[").replace("]", r"\]")):
        Quantization(**kwargs)


def test_quantize_takes_a_quantization_not_a_string():
    with pytest.raises(ShardkitError, match="quantize must be a shardkit.Quantization"):
        ShardConfig.build("FULL_SHARD", None, False, 1, None, quantization="int8")


# ---- collectives against the formula ---------------------------------------------------------
@pytest.mark.parametrize("world", [2, 4])
def test_quantized_collectives_equal_the_formula(world):
    payload = payload_bytes(ROW, BLOCK)  # 150 values: 3 blocks of 64 codes + 3 scales = 204 bytes
    results = shardkit.spawn(collectives, world, world, threads_per_rank=1)
    # The all-reduce's result is decoded from the same gathered bytes on every rank.
    assert len({r["all_reduce_value"] for r in results}) == 1
    for rank, r in enumerate(results):
        # Each rank receives every rank's quantized row and sums in fp32: exactly the formula.
        assert r["one_hop"] == 0.0 and r["all_reduce"] == 0.0, (rank, r)
        # ... and that is near, not equal to, the exact sum (the code is really lossy).
        assert 1e-4 < r["one_hop_vs_exact"] < 0.5, r
        assert r["one_hop_bytes"] == (world - 1) * payload
        width = payload_bytes(-(-(world * ROW - 5) // world), BLOCK)
        assert r["all_reduce_bytes"] == 2 * (world - 1) * width  # all-to-all, then all-gather
        if world == 4:  # two nodes of two ranks
            assert r["two_hop"] == 0.0, r
            # Hop one inside the node sends both nodes' rows to the one peer; hop two one row
            # to the other node: a node's ranks send half of what one hop sends across.
            assert r["two_hop_bytes"] == (2 * payload + payload, payload)
            assert r["one_hop_split"] == (3 * payload, 2 * payload)


@pytest.mark.parametrize("world", [2, 4])
def test_a_unit_computes_with_each_ranks_row_decoded_and_the_master_stays_exact(world):
    for r in shardkit.spawn(gathered_weight, world, world, threads_per_rank=1):
        assert r["diff"] == 0.0 and 1e-5 < r["vs_exact"] < 1e-2, r
        assert r["master_exact"] == 0.0, r
        # body: forward + backward gathers of one row of 2400 / world values; head: 900 values
        # in rows of ceil(3 / world) x 300, gathered once (the root keeps them for backward).
        body = payload_bytes(2400 // world, BLOCK)
        head = payload_bytes(-(-3 // world) * 300, BLOCK)
        assert r["gathers"] == (world - 1) * (2 * body + head)


# ---- training ------------------------------------------------------------------------------
_RUNS = ([(s, q, {}) for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
          for q in ("exact", "weights", "gradients", "both")
          if not (s == "NO_SHARD" and q in ("weights", "both"))]  # refused: no weights gathered
         + [("HYBRID_SHARD", q, {"hybrid_group_size": 2}) for q in ("exact", "both")]
         + [("FULL_SHARD", "both", {"prefetch": 2}), ("FULL_SHARD", "both", {"cpu_offload": True}),
            ("FULL_SHARD", "both", {"reshard_after_forward": 2}),
            ("FULL_SHARD", "both", {"checkpoint_layers": True})])


@pytest.mark.long  # 11 s on 2 cores
def test_quantized_training_stays_near_the_unsharded_run_and_replicas_agree():
    results = shardkit.spawn(training, 4, 4, _RUNS, threads_per_rank=1)
    for key, run in results[0].items():
        # Every rank decodes the same bytes: the replicas hold identical weights.
        assert all(r[key]["digest"] == run["digest"] for r in results), key
        worst = max(run["diffs"])
        if key.split("/")[1] == "exact":
            assert worst < 1e-6, (key, worst)
        else:
            # 5 SGD steps (lr 1e-2) of a TinyNet: measured 1.5e-4 (gradients) to 6.2e-4 (both).
            assert 1e-5 < worst < 2e-3, (key, worst)


def test_bf16_compute_with_quantized_collectives_stays_near_the_same_run_unquantized():
    for r in shardkit.spawn(mixed_precision_training, 2, 2, threads_per_rank=1):
        # bf16 gathers already round each weight to 8 bits of mantissa; int8 blocks add about
        # as much again. Measured 3.4e-4 after 5 SGD steps (lr 1e-2).
        assert 1e-5 < max(r["diffs"]) < 2e-3, r["diffs"]


@pytest.mark.long  # 12 s in the default lane on 2 cores (2026-11-29)
def test_comm_bytes_equal_the_planners_for_every_strategy():
    keys = ("all_gather", "reduce_scatter", "all_reduce", "total", "calls")
    cases = [("FULL_SHARD", None), ("SHARD_GRAD_OP", None), ("NO_SHARD", None), ("HYBRID_SHARD", 2)]
    settings = [Quantization(weights=True), Quantization(gradients=True, block_size=64),
                Quantization(weights=True, gradients=True)]
    measured = shardkit.spawn(step_bytes, 4, 4, cases, settings, threads_per_rank=1)[0]
    for (strategy, group), q in [(c, q) for c in cases for q in settings
                                 if not (c[0] == "NO_SHARD" and q.weights)]:
        torch.manual_seed(0)
        planned = shardkit.plan(TinyNet(), 4, strategy=strategy, optimizer="adamw",
                                auto_wrap_policy=shardkit.wrap.transformer_layers({Block}),
                                quantize=q, hybrid_group_size=group)
        got = measured[f"{strategy}/{q}"]
        assert {k: got[k] for k in keys} == {k: planned.comm[k] for k in keys}, (strategy, q)


def test_quantized_reductions_are_refused_where_the_backend_has_no_all_to_all():
    from shardkit import Backend, Capabilities
    from shardkit.sharding.api import _check_quantization

    class NoAllToAll(Backend):
        name = "no-all-to-all"
        capabilities = Capabilities(torch_process_group=False)  # its own collectives, not torch's

    grads = ShardConfig.build("FULL_SHARD", None, False, 1, None,
                              quantization=Quantization(gradients=True))
    with pytest.raises(ShardkitError, match="has none .* HINT: quantize the weights only"):
        _check_quantization(grads, NoAllToAll())
    weights = ShardConfig.build("FULL_SHARD", None, False, 1, None,
                                quantization=Quantization(weights=True))
    _check_quantization(weights, NoAllToAll())  # gathers need only the all-gather it has
    # The planner holds the same check (issue 52: it returned bytes for what shard() refuses).
    with pytest.raises(ShardkitError, match="has none .* HINT: quantize the weights only"):
        shardkit.plan(TinyNet(), 2, quantize=Quantization(gradients=True), backend=NoAllToAll())
    assert shardkit.plan(TinyNet(), 2, quantize=Quantization(weights=True),
                         backend=NoAllToAll()).quantized


@pytest.mark.parametrize("value", [0, "", False, "weights", {"weights": True}])
def test_a_quantize_value_that_is_not_a_quantization_is_refused_not_taken_for_exact(value):
    with pytest.raises(ShardkitError, match=r"quantize must be a shardkit.Quantization .* or None "
                                            r"for exact collectives, got"):
        shardkit.plan(TinyNet(), 2, quantize=value)


def test_weights_quantized_under_no_shard_is_refused():
    with pytest.raises(ShardkitError, match=r"Quantization\(weights=True\) under NO_SHARD "
                                            r"quantizes nothing.*HINT: Quantization\(gradients=True\)"):
        shardkit.plan(TinyNet(), 2, strategy="NO_SHARD", quantize=Quantization(weights=True))
    assert shardkit.plan(TinyNet(), 2, strategy="NO_SHARD",
                         quantize=Quantization(gradients=True)).quantized


def test_replicate_with_quantize_names_the_shard_route():
    with pytest.raises(ShardkitError, match=r"replicate\(\) is torch's DDP.*strategy='NO_SHARD'"):
        shardkit.replicate(TinyNet(), quantize=Quantization(gradients=True))


@pytest.mark.parametrize("argv, said", [
    (["--quantize-block", "64"], "--quantize-block sets the block size of --quantize, which is not given"),
    (["--quantize", "both", "--quantize-block", "4"], "argument --quantize-block: expected 8 to 1048576"),
])
def test_the_plan_command_refuses_a_block_size_it_would_ignore_or_misname(argv, said, capsys):
    from shardkit.cli.main import main

    try:
        code = main(["plan", "--hf-config", "gpt2", "--world-size", "2", *argv])
    except SystemExit as exc:  # argparse's own exit for a value it refuses
        code = exc.code
    assert code in (1, 2), code  # at once: the model is not built
    assert said in capsys.readouterr().err


def test_the_cli_block_bounds_are_quantizations():
    from shardkit.planner import cli
    from shardkit.sharding import policies

    assert (cli.MIN_QUANT_BLOCK, cli.MAX_QUANT_BLOCK) == (policies.MIN_QUANT_BLOCK,
                                                          policies.MAX_QUANT_BLOCK)


@pytest.mark.long
def test_the_cli_plans_quantized_bytes_per_node():
    import json
    import subprocess
    import sys

    pytest.importorskip("transformers")
    outs = {}
    for extra in ([], ["--quantize", "both"]):
        done = subprocess.run([sys.executable, "-m", "shardkit", "plan", "--hf-config", "gpt2",
                               "--world-size", "16", "--nodes", "2", "--json", *extra],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        outs[bool(extra)] = json.loads(done.stdout)["comm"]
    exact, quantized = outs[False], outs[True]
    # int8 codes + a 4-byte scale per 256: 1/4 of fp32 and 1.6 % more, so 3.94x fewer bytes;
    # across nodes the two-hop reduction sends one row per node pair instead of one per rank.
    assert exact["total"] / quantized["total"] == pytest.approx(4 / (1 + 4 / 256), rel=0.01)
    across = [sum(r["total"] for r in c["inter_node_by_rank"]) for c in (exact, quantized)]
    assert across[0] / across[1] > 4.5


@pytest.mark.extended  # about 85 s; CI's long lane keeps quantized training near the unsharded run
def test_a_language_model_trained_quantized_ends_where_the_exact_one_does():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_quantize

    steps, tail = 200, 20
    final = {}
    for setting in ("exact", "both"):
        ranks = shardkit.spawn(bench_quantize.train, 4, 4, setting, steps, 8, threads_per_rank=1)
        losses = ranks[0]["losses"]
        assert all(r["losses"] == losses for r in ranks)  # the global mean, on every rank
        final[setting] = sum(losses[-tail:]) / tail
    floor = bench_quantize.entropy_rate(bench_quantize.chain())
    # It learned the language: within 0.5 nats of its entropy rate (the loss starts near 40).
    assert final["exact"] - floor < 0.5
    # benchmarks/bench_quantize.py, 400 steps: +0.0023 nats (exact 1.4437); here 200 steps.
    assert abs(final["both"] - final["exact"]) < 0.02, final
