"""torch.compile per block and activation checkpointing inside sharded units, on 2 ranks (gloo).

Compiled runs are compared with the same sharded model in eager mode (which the parity suite
compares with unsharded training); checkpointed runs with the same model without checkpointing.
"""

from __future__ import annotations

import pytest

import shardkit

from _speed_workers import STEPS, STRATEGIES, checkpoint_run, compile_run, profile_run

pytestmark = pytest.mark.slow
TINY = {"dim": 14, "blocks": 2, "tokens": 16, "hidden": 29, "batch": 4}  # _models.TinyNet


@pytest.mark.slow
@pytest.mark.long  # 12 s: every strategy compiled
def test_compiled_blocks_match_eager_under_every_strategy_without_recompiling():
    for r in shardkit.spawn(compile_run, 2, 2, threads_per_rank=1):
        for strategy in STRATEGIES:
            run = r[strategy]
            assert run["compiled_layers"] == TINY["blocks"]
            assert len(run["compiled"]) == STEPS
            diffs = [abs(a - b) for a, b in zip(run["eager"], run["compiled"])]
            assert max(diffs) <= 1e-5, (strategy, diffs)
            graphs = run["graphs_per_step"]
            # Graphs were compiled (so the compiled path really ran) and none after step 2.
            assert graphs[0] >= 1 and graphs[1:] == [graphs[1]] * (STEPS - 1), (strategy, graphs)


def test_activation_checkpointing_same_grads_and_saves_activation_memory():
    t = TINY
    # Without checkpointing each block keeps at least its MLP hidden activation (the ReLU output
    # fc2 reads) and its attention matrix (softmax output) for backward, in fp32.
    floor = t["blocks"] * t["batch"] * t["tokens"] * (t["hidden"] + t["tokens"]) * 4
    for r in shardkit.spawn(checkpoint_run, 2, 2, threads_per_rank=1):
        for strategy, run in r.items():
            assert run["grad_diff"] <= 1e-6, (strategy, run["grad_diff"])
            assert run["saved_plain"] - run["saved_ac"] >= floor, (strategy, run)
            diffs = [abs(a - b) for a, b in zip(run["losses_plain"], run["losses_ac"])]
            assert len(diffs) == STEPS and max(diffs) <= 1e-6, (strategy, diffs)


def test_profiler_ranges_name_every_engine_phase():
    for r in shardkit.spawn(profile_run, 2, 2, threads_per_rank=1):
        names = set(r["names"])
        for op in ("all_gather", "reduce_scatter", "copy_in", "copy_out", "pack_grads"):
            assert f"shardkit::{op}" in names, (op, sorted(names))
        for phase in ("pre_forward", "post_forward", "pre_backward", "post_backward"):
            assert f"shardkit::{phase}[blocks.0]" in names, (phase, sorted(names))
        assert r["shared_noop"]  # no profiler: no record_function call on the hot path
