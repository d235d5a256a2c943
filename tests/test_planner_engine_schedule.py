"""The planner's bytes per step, unit by unit and call by call, equal what the engine's own hooks
issue in a step (tests/_engine_schedule.py: the engine sharding a meta copy, stand-in forwards,
no batch): every strategy, an int reshard_after_forward, direct buckets, int8 collectives in one
and two hops, HYBRID across nodes. The measured runs (test_planner_measured.py, test_quantize.py)
hold the same bytes against comm_stats of real ranks for fewer layouts."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import shardkit
from shardkit.planner.build import plan_target
from shardkit.wrap import transformer_layers

from _engine_schedule import engine_schedule
from _planner_families import family

INT8 = shardkit.Quantization(weights=True, gradients=True)
CASES = [  # (strategy, world, hybrid group, nodes, backend, extra shard()/plan() options)
    ("FULL_SHARD", 2, None, None, "cpu", {}),  # cpu: the embedding and head are direct buckets
    ("SHARD_GRAD_OP", 3, None, None, "cpu", {}),
    ("NO_SHARD", 2, None, None, "cpu", {}),
    ("HYBRID_SHARD", 4, 2, 2, "cpu", {}),
    ("FULL_SHARD", 4, None, None, "cpu", {"reshard_after_forward": 2}),
    ("FULL_SHARD", 4, None, None, "cpu", {"prefetch": 2}),
    ("FULL_SHARD", 2, None, None, "cpu", {"quantize": INT8}),
    ("HYBRID_SHARD", 4, 2, 2, "cpu", {"quantize": INT8}),
    ("FULL_SHARD", 8, None, 2, "cpu", {"quantize": INT8}),  # the shard group spans 2 nodes: two hops
    ("FULL_SHARD", 4, None, None, "cuda", {
        "mixed_precision": shardkit.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[4]}-{'-'.join(c[5]) or 'plain'}")
def test_the_plan_counts_each_units_calls_as_the_engine_issues_them(case):
    strategy, world, hybrid, nodes, backend, extra = case
    fam = family("qwen2")
    with torch.device("meta"):
        model = fam.make()
    policy = transformer_layers(set(fam.blocks))
    plan = shardkit.plan(model, world_size=world, strategy=strategy, auto_wrap_policy=policy,
                         hybrid_group_size=hybrid, nodes=nodes, backend=backend, **extra)
    comm, calls = engine_schedule(model, world, plan_target(backend, None).capabilities,
                                  world // nodes if nodes else None, strategy=strategy,
                                  auto_wrap_policy=policy, hybrid_group_size=hybrid, **extra)
    assert {k: comm[k] for k in plan.comm if k in comm} == {
        k: plan.comm[k] for k in plan.comm if k in comm}
    assert plan.comm["total"] > 0
    # Unit by unit: the same calls (kind, bytes, ranks), whatever order prefetch issues them in.
    assert {u.name: Counter(u.collectives) for u in plan.units} == {
        u.name: Counter(calls.get(u.name, [])) for u in plan.units}
    if extra.get("quantize") and nodes and hybrid is None:
        assert {kind for u in plan.units for kind, _, _ in u.collectives} >= {"a2a_node", "a2a_across"}
