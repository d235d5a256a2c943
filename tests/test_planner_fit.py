"""What fits: the recorded step replayed per batch and configuration, and the searches on it."""

from __future__ import annotations

import pytest
import torch

import shardkit
from shardkit.cli.main import main
from shardkit.planner.cli import memory_size
from shardkit.planner.fit import fit_table, largest_batch, smallest_world_size
from shardkit.planner.replay import ALLOC, FREE, StepRecord, Timeline
from shardkit.planner.build import plan_target
from shardkit.planner.workload import Workload
from shardkit.wrap import transformer_layers

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaDecoderLayer  # noqa: E402

MiB = 2**20
LLAMA = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1000)
WRAP = transformer_layers({LlamaDecoderLayer})


def _llama():
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))


@pytest.mark.parametrize("ac", [False, True])
def test_two_rehearsals_give_every_batch_exactly(ac):
    # A configuration's timeline through two batch sizes against a rehearsal at each batch.
    model = _llama()
    workload = Workload(model, 64, None, {"auto_wrap_policy": WRAP}, "adamw",
                        plan_target("cpu", None))
    for strategy, offload in [("FULL_SHARD", False), ("SHARD_GRAD_OP", True), ("NO_SHARD", False)]:
        through = workload.timeline(2, strategy, offload, ac)
        assert through.batches == (2, 3) and not through.valid_at(1)  # llama: other ops at 1
        for batch in (3, 5):
            assert through.peak(batch) == workload.timeline(2, strategy, offload, ac, batch).peak(batch)


def test_recordings_that_run_different_ops_are_not_extrapolated():
    one = StepRecord(1, ((ALLOC, 8), (FREE, 0)))
    other = StepRecord(2, ((ALLOC, 16), (ALLOC, 4), (FREE, 0)))
    with pytest.raises(shardkit.ShardkitError, match="different ops at batch sizes 1 and 2"):
        Timeline.between(one, other)
    with pytest.raises(shardkit.ShardkitError, match="not proportional"):
        Timeline.between(StepRecord(1, ((ALLOC, 8),)), StepRecord(3, ((ALLOC, 11),)))
    with pytest.raises(shardkit.ShardkitError, match="batch 1 only, not 2"):
        Timeline.at(one).peak(2)


def _direct_peak(model, world, batch, **options):
    return shardkit.plan(model, world, auto_wrap_policy=WRAP, batch=batch, seq=64,
                         **options).peak_bytes


def test_largest_batch_is_the_edge_by_direct_plans():
    model = _llama()
    budget = 12 * MiB
    for ac in (False, True):
        fit = largest_batch(model, 2, budget, 64, auto_wrap_policy=WRAP, activation_checkpointing=ac)
        assert fit.fits and fit.batch >= 2
        assert fit.plan.peak_bytes == _direct_peak(model, 2, fit.batch, activation_checkpointing=ac)
        assert fit.plan.peak_bytes <= budget
        assert _direct_peak(model, 2, fit.batch + 1, activation_checkpointing=ac) > budget
    nothing = largest_batch(model, 2, 1 * MiB, 64, auto_wrap_policy=WRAP)
    assert nothing.batch == 0 and not nothing.fits and nothing.plan.batch == 1
    assert "does not fit in 1 MiB per rank: needs" in nothing.summary()


@pytest.mark.long  # 12 s of rehearsals: out of the default lane (under 10 minutes)
def test_fit_table_rows_agree_with_one_search_each_and_offload_never_fits_less():
    model = _llama()
    rows = fit_table(model, 2, 12 * MiB, 64, auto_wrap_policy=WRAP)
    assert [(r.strategy, r.activation_checkpointing, r.cpu_offload) for r in rows] == [
        (s, ac, off) for s in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
        for ac in (False, True) for off in (False, True)]
    for row in rows[::3]:
        alone = largest_batch(model, 2, 12 * MiB, 64, strategy=row.strategy, auto_wrap_policy=WRAP,
                              activation_checkpointing=row.activation_checkpointing,
                              cpu_offload=row.cpu_offload)
        assert (alone.batch, alone.plan.peak_bytes) == (row.batch, row.plan.peak_bytes)
    for on_device, offloaded in zip(rows[::2], rows[1::2]):
        assert offloaded.batch >= on_device.batch
    with pytest.raises(shardkit.ShardkitError, match="reshard_after_forward defaults"):
        fit_table(model, 2, 12 * MiB, 64, auto_wrap_policy=WRAP, reshard_after_forward=False)


@pytest.mark.long  # 13 s in the default lane on 2 cores (2026-11-29)
def test_smallest_world_size_is_the_edge_and_hybrid_and_no_shard_answer_honestly():
    model = _llama()
    budget = 8 * MiB
    fit = smallest_world_size(model, budget, 2, 64, auto_wrap_policy=WRAP)
    assert fit.fits and fit.world_size > 1
    assert _direct_peak(model, fit.world_size, 2) <= budget < _direct_peak(model, fit.world_size - 1, 2)
    assert fit.plan.world_size == fit.world_size and fit.plan.batch == 2
    # Replication does not shrink a rank's memory: NO_SHARD fits on one rank or on none.
    never = smallest_world_size(model, budget, 2, 64, strategy="NO_SHARD", auto_wrap_policy=WRAP,
                                max_world_size=64)
    assert never.world_size is None and not never.fits
    assert "does not fit" in never.summary()
    # HYBRID: only the shard group divides memory; world sizes are multiples of the group.
    wide = fit.world_size + 1
    hybrid = smallest_world_size(model, budget, 2, 64, strategy="HYBRID_SHARD",
                                 hybrid_group_size=wide, auto_wrap_policy=WRAP)
    assert hybrid.world_size == wide and hybrid.plan.shard_group_size == wide
    narrow = smallest_world_size(model, budget, 2, 64, strategy="HYBRID_SHARD", max_world_size=64,
                                 hybrid_group_size=fit.world_size - 1, auto_wrap_policy=WRAP)
    assert narrow.world_size is None
    static = smallest_world_size(model, budget, auto_wrap_policy=WRAP)  # no batch: no activations
    assert static.plan.step_bytes is None and "activations not included" in static.summary()


def test_memory_sizes_parse_in_both_unit_families():
    assert memory_size("80GiB") == 80 * 2**30
    assert memory_size("80 GB") == 80 * 10**9
    assert memory_size("81920MiB") == 80 * 2**30
    assert memory_size("1.5gib") == 3 * 2**29
    assert memory_size("4096") == 4096
    for bad in ("80 parsecs", "-1GiB", "GiB", "0"):
        with pytest.raises(Exception, match="expected a size such as 80GiB"):
            memory_size(bad)


HF = ["plan", "--hf-config", "llama"] + [a for k, v in LLAMA.items() for a in ("--set", f"{k}={v}")]


@pytest.mark.long  # 14 s on 2 cores
def test_cli_what_fits_table_fewest_ranks_and_the_errors(capsys):
    assert main(HF + ["--world-size", "2", "--device-memory", "12MiB", "--seq", "64"]) == 0
    out = capsys.readouterr().out
    assert "largest batch per rank x seq 64 in 12 MiB per rank on 2 rank(s)" in out
    assert sum(line.startswith(("FULL_SHARD ", "SHARD_GRAD_OP ", "NO_SHARD ")) for line in out.splitlines()) == 12
    assert main(HF + ["--world-size", "auto", "--device-memory", "12.5MiB", "--batch", "2",
                      "--seq", "64"]) == 0
    assert "fewest ranks: FULL_SHARD: batch 2 per rank on " in capsys.readouterr().out
    assert main(HF + ["--world-size", "2", "--device-memory", "8MiB", "--batch", "64",
                      "--seq", "64"]) == 1
    assert "batch 64 does NOT fit; the largest that does is" in capsys.readouterr().out
    assert main(HF + ["--world-size", "auto"]) == 1
    assert "give --device-memory" in capsys.readouterr().err
    assert main(HF + ["--world-size", "2", "--device-memory", "8MiB"]) == 1
    assert "give --seq" in capsys.readouterr().err
