"""MixedPrecision output_dtype / cast_forward_inputs, register_forward_method, and the engine on
exact AVG / PREMUL_SUM, on 2 ranks (gloo) against references; one spawn shared by every test."""

from __future__ import annotations

import pytest

import shardkit
from _ops_workers import ExactOpsCPU, ops_suite

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TOL = 1e-5


@pytest.fixture(scope="module")
def results():
    return shardkit.spawn(ops_suite, 2, 2, backend=ExactOpsCPU(), threads_per_rank=1)


def _ok(run):
    return run["init_diff"] == 0.0 and len(run["diffs"]) == 5 and max(run["diffs"]) <= TOL


# FULL_SHARD reduce-scatters over both ranks; NO_SHARD's scatter is local (a one-rank group), so
# the exact op goes on its all-reduce. PREMUL_SUM carries the factor 1/world.
EXPECTED_CALLS = {
    ("avg", "FULL_SHARD"): [("reduce_scatter", "avg", None)],
    ("avg", "NO_SHARD"): [("all_reduce", "avg", None), ("reduce_scatter", "sum", None)],
    ("premul_sum", "FULL_SHARD"): [("reduce_scatter", "premul_sum", 0.5)],
    ("premul_sum", "NO_SHARD"): [("all_reduce", "premul_sum", 0.5), ("reduce_scatter", "sum", None)],
}


@pytest.mark.parametrize("op,strategy", list(EXPECTED_CALLS))
def test_engine_averages_with_the_declared_op_and_no_divide(results, op, strategy):
    for r in results:
        case = r["exact_ops"][op]
        assert _ok(case[strategy])
        assert case[f"{strategy}_calls"] == EXPECTED_CALLS[op, strategy]
        assert case[f"{strategy}_divides"] == 0


def test_sum_and_divide_where_no_exact_op_is_declared(results):
    for r in results:
        case = r["exact_ops"]["sum"]
        for strategy in ("FULL_SHARD", "NO_SHARD"):
            assert _ok(case[strategy])
            assert {op for _k, op, _f in case[f"{strategy}_calls"]} == {"sum"}
            assert case[f"{strategy}_divides"] == 3  # one post-divide per unit (3 units)


def test_exact_ops_send_the_same_bytes_and_give_the_same_numbers(results):
    for r in results:
        cases = r["exact_ops"]
        assert cases["avg"]["bytes"] == cases["premul_sum"]["bytes"] == cases["sum"]["bytes"]
        assert cases["avg"]["bytes"]["reduce_scatter"] > 0
        # gloo's AVG is SUM then divide, the pre-scaled sum exact at world 2: bit-identical.
        assert cases["avg"]["FULL_SHARD"]["diffs"] == cases["sum"]["FULL_SHARD"]["diffs"]


def test_the_test_backend_passes_the_exact_op_conformance_check(results):
    for r in results:
        assert r["exact_ops"]["conformance"] == {"exact_reduce_ops": None}


def test_output_dtype_casts_the_model_outputs_and_matches_the_reference(results):
    for r in results:
        run = r["output_dtype"]
        assert run["dtypes"] == ["torch.float32"] * 3
        assert run["inner_output_dtype"] == ["torch.bfloat16"]  # root only
        assert max(run["loss_diffs"]) <= TOL and max(run["diffs"]) <= TOL


def test_cast_forward_inputs_false_leaves_inputs_alone(results):
    for r in results:
        run = r["cast_inputs"]
        assert run[True]["root"] == run[True]["inner"] == ["torch.bfloat16"]
        assert run[False]["root"] == run[False]["inner"] == ["torch.float32"]
        assert run[True]["equal"] and run[False]["equal"]


def test_registered_methods_gather_and_train_like_the_reference(results):
    for r in results:
        run = r["forward_method"]
        # Unregistered, encode() calls layers holding row shards: refused, not a silent slice.
        assert run["unregistered"] and run["unregistered"].startswith("ShardkitError")
        assert "register_forward_method" in run["unregistered"]
        assert "'head.weight'" in run["direct_layer"] and "(5, 14)" in run["direct_layer"]
        assert run["direct_in_unshard_diff"] <= TOL
        assert max(run["diffs"]) <= TOL and run["eval_diff"] <= TOL
        assert run["sharded_after"]
        assert "is not a sharding unit" in run["errors"]["not_a_unit"]
        assert "has no method 'decode'" in run["errors"]["no_method"]
        # A registered training_step that calls forward and encode() inside: hooks once.
        assert len(run["nested"]["diffs"]) == 3 and max(run["nested"]["diffs"]) <= TOL
        assert run["nested"]["sharded_after"]
        # ... and gathers the root unit once, not again for the forward and encode() inside it.
        sent = run["nested"]["gathered"]
        assert sent["encode"] > sent["blocks"] > 0  # the root's own share is gathered by encode
        assert sent["training_step"] == sent["forward"] + sent["blocks"], sent


def test_gpt2_generate_gives_the_unsharded_tokens(results):
    for r in results:
        run = r["generate"]
        if isinstance(run, str):
            pytest.skip(run)
        assert len(run["want"][0]) == 12 and len(set(run["want"][0][4:])) > 1
        # generate() calls forward, so it works registered or not; registered it also gathers
        # what generate touches outside forward.
        assert run["registered"] == run["want"] and run["plain"] == run["want"]
        assert run["sharded_after"]

