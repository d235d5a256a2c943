"""shardkit.plan() against measurement across processes: bytes per step equal comm_stats exactly,
persistent memory equals the tensors the optimizer holds and is within 5% of process RSS.

The plans are made here, in the test process, on meta-device models (no init, no group); the
ranks only train and measure (tests/_planner_workers.py, one spawn per world size).
"""

from __future__ import annotations

import pytest
import torch

import shardkit

from _planner_workers import (DIRECT_STRATEGIES, RESHARD_CASES, Wide, comm_cases, memory_cases,
                              memory_kwargs, shard_kwargs, spawn_suite, tiny)

pytestmark = pytest.mark.slow  # multi-process: runs by default, skipped by -m 'not slow'

KEYS = ("all_gather", "reduce_scatter", "all_reduce", "total", "calls")


@pytest.mark.parametrize("world", [1, 2, 3, pytest.param(4, marks=pytest.mark.long)])
def test_bytes_per_step_equal_comm_stats(world):
    results = spawn_suite(world)
    cases = comm_cases(world)
    assert len(cases) >= 7
    for i, case in enumerate(cases):
        with torch.device("meta"):
            model = tiny(case["frozen"])
        planned = shardkit.plan(model, world_size=world, **shard_kwargs(case))
        for rank, result in enumerate(results):
            for step, stats in enumerate(result["comm"][i]):
                measured = {k: stats[k] for k in KEYS}
                assert measured == planned.comm, (case, rank, step)
        if world > 1 and case["strategy"] != "NO_SHARD" and planned.shard_group_size > 1:
            assert planned.comm["all_gather"] > 0  # the comparison covered real traffic


def test_persistent_memory_equals_held_tensors_and_rss():
    results = spawn_suite(2)
    for i, case in enumerate(memory_cases()):
        with torch.device("meta"):
            model = Wide()
        planned = shardkit.plan(model, world_size=2, **memory_kwargs(case))
        assert planned.persistent["total"] >= 40 * 2**20  # large against the process's noise
        for rank, result in enumerate(results):
            m = result["memory"][i]
            # Parameters and gradients are padded shards on every rank; optimizer state is
            # made by torch from each DTensor's real rows, so ranks with fewer rows hold less
            # (the plan is the fullest rank's, rank 0's).
            held, plan = m["held"], planned.persistent
            assert (held["params"], held["grads"]) == (plan["params"], plan["grads"]), (case, rank)
            assert held["optimizer"] <= plan["optimizer"], (case, rank)
            if rank == 0:
                assert held == plan, case
            # RSS from before building the model to after optimizer.step(), the engine's
            # buffer pool cleared (transient communication buffers, not state).
            assert abs(m["rss_delta"] - planned.persistent["total"]) <= \
                0.05 * planned.persistent["total"], (case, rank, m["rss_delta"])
        if case["cpu_offload"]:
            assert planned.persistent_host == planned.persistent["total"]


@pytest.mark.long  # 11 s in the default lane on 2 cores (2026-11-29)
def test_reshard_after_forward_int_equals_comm_stats():
    results = spawn_suite(4)
    for i, (value, case) in enumerate(RESHARD_CASES):
        with torch.device("meta"):
            model = tiny(case["frozen"])
        planned = shardkit.plan(model, world_size=4, reshard_after_forward=value,
                                **shard_kwargs(case))
        for rank, result in enumerate(results):
            for step, stats in enumerate(result["reshard_int"][i]):
                assert {k: stats[k] for k in KEYS} == planned.comm, (value, case, rank, step)


def test_direct_buckets_of_the_backend_are_planned_from_its_capabilities():
    """Wide's 1024 x 1024 weights reach the cpu backend's direct_collective_numel (1 << 20): each
    gets its own all-gather and reduce-scatter, and plan(backend="cpu") counts exactly those."""
    results = spawn_suite(2)
    for i, strategy in enumerate(DIRECT_STRATEGIES):
        with torch.device("meta"):
            model = Wide()
        kwargs = {"strategy": strategy, "auto_wrap_policy": shardkit.wrap.ModuleListItems()}
        planned = shardkit.plan(model, world_size=2, backend="cpu", **kwargs)
        generic = shardkit.plan(model, world_size=2, **kwargs)  # no backend: no direct buckets
        # Each weight of >= 1M elements: one more call per gather and per reduction.
        direct = sum(p.numel() >= 1 << 20 for p in model.parameters())
        assert direct == 5
        gathers = 2 if strategy == "FULL_SHARD" else 1
        assert planned.comm["calls"]["all_gather"] == generic.comm["calls"]["all_gather"] + \
            direct * gathers
        assert planned.comm["calls"]["reduce_scatter"] == \
            generic.comm["calls"]["reduce_scatter"] + direct
        assert planned.comm["total"] == generic.comm["total"]
        for rank, result in enumerate(results):
            for step, stats in enumerate(result["direct_comm"][i]):
                assert {k: stats[k] for k in KEYS} == planned.comm, (strategy, rank, step)
