"""FSDP2's control knobs: reshard_after_forward (True / False / int k, per unit), explicit
prefetch, set_requires_gradient_sync; each against unsharded training on the concatenated
batch, and bytes / held memory against formulas computed here from the layout alone."""

from __future__ import annotations

import pytest

from _knob_workers import MIXED, spawn_knobs
from _sharding_workers import STEPS

pytestmark = pytest.mark.slow  # multi-process: runs by default, skipped by -m 'not slow'

TOL = 1e-5
FP32, BF16 = 4, 2
UNITS = ("blocks.0", "blocks.1", "<root>")


def _ok(run):
    return run["init_diff"] == 0.0 and len(run["diffs"]) == STEPS and max(run["diffs"]) <= TOL


def _unit(fqn):
    return next((u for u in UNITS[:2] if fqn.startswith(u + ".")), "<root>")


def _expected(layout, spec, n, compute_bytes, reduce_bytes=FP32):
    """(forward all-gather, backward all-gather, reduce-scatter, held between) bytes per rank."""
    padded = {u: sum(p["padded"] for p in layout if _unit(p["fqn"]) == u) for u in UNITS}
    total = sum(padded.values())
    backward = held = 0.0
    for u in UNITS:
        k = spec[u] if isinstance(spec, dict) else spec
        k = n if k is True else 1 if k is False else k
        # After forward a unit keeps padded/k of each param; backward gathers the rest over k ranks.
        backward += (k - 1) * padded[u] / k * compute_bytes
        held += 0 if k == n else padded[u] / k * compute_bytes
    return ((n - 1) * total / n * compute_bytes, backward, (n - 1) * total / n * reduce_bytes, held)


def _check_bytes(b, spec, n, compute_bytes):
    fwd, bwd, rs, held = _expected(b["layout"], spec, n, compute_bytes)
    assert b["forward"]["all_gather"] == fwd and b["forward"]["reduce_scatter"] == 0
    assert b["backward"]["all_gather"] == bwd
    assert b["backward"]["reduce_scatter"] == rs
    assert b["forward"]["total"] + b["backward"]["total"] == fwd + bwd + rs  # the whole step
    assert b["held_between"] == held
    assert b["held_after"] == 0


# The three spawn_knobs(4) tests share one cached 4-rank run (36 s on 2 cores, paid by the
# first): marking one long moves no time out of the default lane (tried 2026-11-29).
def test_int_reshard_trains_like_the_reference_at_world_4():
    for r in spawn_knobs(4):
        for name in ("k2", "dict", "callable", "k2_no_sync", "k2_checkpointed"):
            assert _ok(r["parity"][name]), name
        assert max(r["mp_k2"]) <= TOL  # bf16 compute, fp32 reduce, against the same casts


def test_int_reshard_bytes_and_held_memory_match_the_formula():
    for r in spawn_knobs(4):
        b = r["bytes"]
        _check_bytes(b["k2"], 2, 4, FP32)
        _check_bytes(b["dict"], MIXED, 4, FP32)
        _check_bytes(b["k2_bf16"], 2, 4, BF16)
        # backward gathers inside 2-rank groups: half the ring steps of the 4-rank gather
        assert b["k2"]["backward"]["calls"] == {"all_gather": 3, "reduce_scatter": 3}
        assert b["dict"]["backward"]["calls"] == {"all_gather": 2, "reduce_scatter": 3}


def test_bad_reshard_values_are_refused_with_the_valid_ones():
    errors = spawn_knobs(4)[0]["errors"]
    assert "must divide the shard group size 4" in errors["not_divisor"]
    assert "[1, 2, 4]" in errors["not_divisor"] and "[1, 2, 4]" in errors["zero"]
    assert "NO_SHARD" in errors["no_shard"]
    assert "'blocks.7'" in errors["unknown_unit"] and "'<root>'" in errors["unknown_unit"]
    assert "got 'two'" in errors["bad_type"]
    assert "reshard_after_forward['blocks.0']=3" in errors["per_unit_bad"]


def test_reshard_one_and_world_behave_as_false_and_true_at_world_2():
    for r in spawn_knobs(2):
        assert _ok(r["parity"]["k1"]) and _ok(r["parity"]["k2"])
        assert max(r["mp_callable"]) <= TOL
        _check_bytes(r["bytes"]["k1"], False, 2, FP32)
        _check_bytes(r["bytes"]["k2"], True, 2, FP32)


def test_no_storage_resize_backend_keeps_the_slice_as_fresh_tensors():
    for r in spawn_knobs(4):
        lazy = r["lazy_like"]
        assert lazy["resize"] is False
        assert _ok(lazy["parity"])
        _check_bytes(lazy["bytes"], 2, 4, FP32)


def test_explicit_prefetch_order_is_followed_and_trains_the_same():
    for r in spawn_knobs(2):
        assert _ok(r["parity"]["explicit_prefetch"])
        default, explicit = r["prefetch"]["default"], r["prefetch"]["explicit"]
        # The bounded default follows the recorded order (forward) and its reverse (backward);
        # backward gathers no root: it kept its parameters from forward (sharding/setup/reshard.py).
        assert default["orders"][1] == {"forward": ["<root>", "blocks.0", "blocks.1"],
                                        "backward": ["blocks.1", "blocks.0"]}
        for step in explicit["orders"]:  # explicit lists apply from the first step
            assert step == {"forward": ["<root>", "blocks.1", "blocks.0"],
                            "backward": ["blocks.0", "blocks.1"]}
        assert explicit["peak"] == 1
        errors = explicit["errors"]
        units = "['blocks.0', 'blocks.1', '<root>']"
        for name in ("not_a_unit", "listed_not_a_unit", "unknown_name"):
            assert "is not a sharding unit" in errors[name] and units in errors[name], name
        assert "module Linear" in errors["not_a_unit"] and "'blocks.9'" in errors["unknown_name"]
        assert "must be a list" in errors["not_a_list"]
        assert "True or False" in errors["sync_not_bool"]


def test_set_requires_gradient_sync_accumulates_unsharded_then_reduces_once():
    for r in spawn_knobs(2):
        run = r["parity"]["grad_sync_flag"]  # 3 micro-batches per step, 2 of them unsynced
        assert _ok(run) and run["rs_calls"] == 5 * len(UNITS)
        layout, steps = r["grad_sync"]["layout"], r["grad_sync"]["steps"]
        full_grads = sum(p["numel"] for p in layout if p["trainable"]) * FP32
        rs = sum(p["padded"] for p in layout if p["trainable"]) / 2 * FP32
        for s in steps[:-1]:
            assert s["stats"]["reduce_scatter"] == 0 and "reduce_scatter" not in s["stats"]["calls"]
            assert s["held_grads"] == full_grads  # one full-size grad per parameter, no more
            assert s["sharded_grads"] == 0
        last = steps[-1]
        assert last["stats"]["reduce_scatter"] == rs
        assert last["held_grads"] == 0 and last["sharded_grads"] == len(layout)
