"""plan(batch=)'s peak is an upper bound: measured <= planned <= 1.10 x measured (issue 34).

Five model families no other planner test uses (an encoder, an encoder-decoder, a grouped-query
decoder, a vision transformer, a mixture-of-experts decoder), fp32 and bf16, checkpointing on
and off, other strategies: each planned in this process from a meta-device model (the engine
rehearsed on meta, planner/rehearsal.py) and measured by two (or four) ranks training the real
model on CPU: torch's allocator high-water mark over the second step (forward, backward,
optimizer.step), from the profiler. The default lane runs two cases; the long lane the rest.
"""

from __future__ import annotations

import gc

import pytest
import torch

import shardkit
from shardkit.wrap import transformer_layers

pytest.importorskip("transformers")

from _planner_families import family, measured_family_peak

pytestmark = pytest.mark.slow  # multi-process

# (family, batch, seq or image side, checkpointing, bf16, strategy, world size)
DEFAULT_CASES = [
    ("bert", 2, 128, False, False, "FULL_SHARD", 2),
    ("vit", 2, 224, True, True, "FULL_SHARD", 2),  # the convolution's scratch (kernel_workspace)
]
_EXTENDED = pytest.mark.extended  # the rest of the table: about 3 min, the extended lane
LONG_CASES = [
    pytest.param(("qwen2", 2, 256, True, True, "FULL_SHARD", 2), marks=_EXTENDED),
    pytest.param(("qwen2-moe", 2, 128, False, False, "FULL_SHARD", 2), marks=_EXTENDED),
    pytest.param(("bert", 2, 128, True, True, "FULL_SHARD", 2), marks=_EXTENDED),
    pytest.param(("bart", 2, 128, False, False, "FULL_SHARD", 2), marks=_EXTENDED),
    pytest.param(("bart", 2, 128, True, True, "FULL_SHARD", 2), marks=_EXTENDED),
    pytest.param(("qwen2", 2, 256, False, False, "FULL_SHARD", 2), marks=_EXTENDED),
    pytest.param(("vit", 2, 224, False, False, "FULL_SHARD", 2), marks=_EXTENDED),
    pytest.param(("vit", 4, 224, True, False, "FULL_SHARD", 2), marks=_EXTENDED),
    pytest.param(("qwen2-moe", 2, 128, True, True, "FULL_SHARD", 2), marks=_EXTENDED),
    ("qwen2", 2, 256, False, False, "SHARD_GRAD_OP", 2),
    ("bart", 2, 128, False, True, "NO_SHARD", 2),
    ("qwen2", 2, 256, False, True, "HYBRID_SHARD", 4),
]
BOUND = 1.10  # the issue's: planned <= 1.10 x measured


def _planned(name, batch, seq, ac, bf16, strategy, world):
    fam = family(name)
    with torch.device("meta"):
        model = fam.make()
    mp = shardkit.MixedPrecision(param_dtype=torch.bfloat16) if bf16 else None
    return shardkit.plan(model, world_size=world, strategy=strategy,
                         hybrid_group_size=2 if strategy == "HYBRID_SHARD" else None,
                         auto_wrap_policy=transformer_layers(set(fam.blocks)), optimizer="adamw",
                         mixed_precision=mp, batch=batch, seq=seq, activation_checkpointing=ac,
                         backend="cpu", threads_per_rank=1,  # the measured ranks' threads
                         example_inputs=lambda b, s: fam.inputs(b, s, "meta"))


def _check(case):
    name, batch, seq, ac, bf16, strategy, world = case
    plan = _planned(*case)
    hybrid = 2 if strategy == "HYBRID_SHARD" else None
    measured = shardkit.spawn(measured_family_peak, world, name, batch, seq, ac, bf16, strategy,
                              False, hybrid, threads_per_rank=1)
    for rank, got in enumerate(measured):
        ratio = plan.peak_bytes / got["peak"]
        print(f"{case}: rank {rank} planned {plan.peak_bytes / 2**20:.2f} MiB (margin "
              f"{plan.margin_bytes / 2**20:.2f}), measured {got['peak'] / 2**20:.2f} MiB: {ratio:.4f}")
        assert got["peak"] <= plan.peak_bytes, (case, rank)
        assert plan.peak_bytes <= BOUND * got["peak"], (case, rank)


@pytest.mark.parametrize("case", DEFAULT_CASES, ids=lambda c: "-".join(map(str, c)))
def test_planned_peak_bounds_the_measured_one(case):
    _check(case)


@pytest.mark.long
@pytest.mark.parametrize("case", LONG_CASES, ids=lambda c: "-".join(map(str, c)))
def test_planned_peak_bounds_the_measured_one_across_the_table(case):
    _check(case)


@pytest.mark.parametrize("strategy, world, offload", [
    ("FULL_SHARD", 2, False), ("SHARD_GRAD_OP", 3, False), ("NO_SHARD", 2, False),
    ("HYBRID_SHARD", 4, False), ("FULL_SHARD", 2, True)])
def test_the_rehearsed_step_sends_what_the_plan_counts(strategy, world, offload):
    # One engine: the bytes the rehearsal's engine counted (its CommStats, as comm_stats says
    # them on a real rank) equal the plan's per-step traffic, worked out from the layout.
    from shardkit.planner.build import plan_target
    from shardkit.planner.workload import Workload

    fam = family("qwen2")
    with torch.device("meta"):
        model = fam.make()
    options = {"auto_wrap_policy": transformer_layers(set(fam.blocks)),
               "hybrid_group_size": 2 if strategy == "HYBRID_SHARD" else None}
    plan = shardkit.plan(model, world_size=world, strategy=strategy, cpu_offload=offload,
                         backend="cpu", **options)
    workload = Workload(model, 64, lambda b, s: fam.inputs(b, s, "meta"), options, "adamw",
                        plan_target("cpu", None))
    comm = workload.rehearsal(world, strategy, offload, False, 2).comm
    assert {k: comm[k] for k in plan.comm} == plan.comm
    assert plan.comm["total"] > 0 or world == 1


def test_planning_leaves_no_model_no_hooks_and_no_job_behind():
    from torch.optim import optimizer as torch_optimizer

    from shardkit.job.runtime import current_context
    from shardkit.sharding.step.state import ShardState

    before = {id(o) for o in gc.get_objects() if isinstance(o, ShardState)}
    pre_hooks = dict(torch_optimizer._global_optimizer_pre_hooks)
    _planned("bert", 1, 16, True, False, "FULL_SHARD", 2)
    gc.collect()
    left = [o for o in gc.get_objects() if isinstance(o, ShardState) and id(o) not in before]
    assert left == []  # the rehearsed model and its engine state are freed with it
    assert dict(torch_optimizer._global_optimizer_pre_hooks) == pre_hooks
    assert current_context() is None  # no job joined, none pretended
