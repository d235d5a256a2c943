"""Engine features on 2 ranks, each against unsharded training on the concatenated batch.

One spawn (shared with the 2-rank parity test) runs every scenario; each test checks one.
"""

from __future__ import annotations

import pytest

from _sharding_workers import spawn_suite

pytestmark = pytest.mark.slow  # multi-process: runs by default, skipped by -m 'not slow'

TOL = 1e-5  # fp32 Adam; observed differences are below 1.1e-6
UNITS = 3  # TinyNet with transformer_layers({Block}): two blocks + the root


@pytest.fixture(scope="module")
def results():
    return [r["features"] for r in spawn_suite(2)]


def _ok(run):
    return run["init_diff"] == 0.0 and len(run["diffs"]) == 5 and max(run["diffs"]) <= TOL


def test_no_sync_accumulation_equals_one_big_batch_and_skips_communication(results):
    for r in results:
        assert _ok(r["no_sync"]) and _ok(r["no_sync_sgo"])
        # One reduce-scatter per unit per optimizer step, not per micro-batch.
        assert r["no_sync"]["rs_calls"] == 5 * UNITS
        assert r["no_sync_sgo"]["rs_calls"] == 5 * UNITS


def test_frozen_parameters_get_no_gradient(results):
    for r in results:
        assert _ok(r["frozen"]) and _ok(r["inputs_no_grad"])
        assert r["frozen"]["frozen_grads"] == [0] * 5
        # frozen params are gathered but never reduced: the reduce-scatter carries only the rest
        b = r["frozen_bytes"]
        assert b["padded_trainable"] < b["padded"]
        assert b["stats"]["reduce_scatter"] == (2 - 1) / 2 * 4 * b["padded_trainable"]
        # (the root is gathered once a step: it keeps its parameters for backward)
        assert b["stats"]["all_gather"] == (2 - 1) / 2 * 4 * (2 * b["padded"] - b["padded_root"])


def test_tied_parameters_across_units(results):
    for r in results:
        assert _ok(r["tied"])


def test_meta_init_equals_eager_init_then_trains_the_same(results):
    for r in results:
        assert _ok(r["meta"])  # init_diff == 0.0 is part of _ok


def test_several_forwards_before_one_backward_and_module_called_twice(results):
    for r in results:
        assert _ok(r["two_forwards"]) and _ok(r["called_twice"])


def test_cpu_offload_keeps_shards_on_cpu(results):
    for r in results:
        assert _ok(r["cpu_offload"]) and r["cpu_offload"]["devices"] == ["cpu"]


def test_prefetch_depth_is_bounded_and_does_not_change_numbers(results):
    for r in results:
        assert _ok(r["prefetch0"]) and _ok(r["prefetch2"])
        assert r["prefetch0"]["peak_in_flight"] == 0
        assert r["prefetch2"]["peak_in_flight"] == 2
        assert r["no_sync"]["peak_in_flight"] == 1  # the default, prefetch=1


def test_mixed_precision_matches_a_reference_doing_the_same_casts(results):
    for r in results:
        assert max(r["mixed_precision"]) <= TOL


def test_unshard_context_gathers_once_and_restores_shards(results):
    for r in results:
        u = r["unshard"]
        assert u["shapes_full"] and u["repeat_equal"] and u["sharded_after"]
        assert u["out_diff"] == 0.0
        assert u["gather_calls"] == u["units"] == UNITS


def test_no_grad_forward_between_steps_sees_the_updated_weights(results):
    for r in results:
        for key in ("eval_full", "eval_sgo"):
            assert _ok(r[key])
            assert len(r[key]["eval_diffs"]) == 5 and max(r[key]["eval_diffs"]) <= 1e-5
