"""The engine's choice of reduce ops (sharding/step/reduce_ops.py) for every combination, without hardware,
and the Backend API's handling of "avg" / "premul_sum"."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from shardkit import Capabilities, ShardkitError, UnsupportedOperationError
from shardkit.handles import Group
from shardkit.sharding.step.reduce_ops import divide_factors
from shardkit.sharding.step.reduce_ops import ReducePlan, reduce_plan
from shardkit_backends.cpu import CPUBackend
from shardkit_backends.xla import XLABackend
from shardkit_backends.xpu import XPUBackend

OP_SETS = [frozenset(s) for s in ([], ["avg"], ["premul_sum"], ["avg", "premul_sum"])]
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
LAYOUTS = ((1, 1), (2, 1), (4, 1), (3, 1), (1, 2), (1, 3), (2, 2), (3, 2))


def _collective(op: str, factor: float | None, parts: list[torch.Tensor]) -> torch.Tensor:
    """What an exact backend returns for `op` over `parts` (a one-rank group is a local copy)."""
    if op == "premul_sum":
        return sum(p * factor for p in parts)
    total = sum(parts)
    return total / len(parts) if op == "avg" and len(parts) > 1 else total


def _run(plan: ReducePlan, grads: torch.Tensor, shard: int, replica: int) -> torch.Tensor:
    """Apply the plan to per-rank grads (rows, rank = replica_index * shard + shard_index)."""
    pre = grads / plan.pre_divide
    by_replica = [_collective(plan.scatter_op, plan.scatter_factor,
                              [pre[g * shard + s] for s in range(shard)]) for g in range(replica)]
    return _collective(plan.replica_op, plan.replica_factor, by_replica) / plan.post_divide


@pytest.mark.parametrize("ops,dtype,layout", list(itertools.product(OP_SETS, DTYPES, LAYOUTS)))
def test_every_plan_computes_the_mean(ops, dtype, layout):
    shard, replica = layout
    world = shard * replica
    plan = reduce_plan(ops, dtype, shard, replica)
    grads = torch.arange(world * 3, dtype=torch.float64).view(world, 3) * 4 - 7
    torch.testing.assert_close(_run(plan, grads, shard, replica), grads.mean(0), rtol=1e-12,
                               atol=1e-12)
    used = {plan.scatter_op, plan.replica_op} - {"sum"}
    assert used <= ops  # never an op the backend did not declare exact
    if used:  # an exact op replaces the engine's own divide kernels
        assert plan.pre_divide == plan.post_divide == 1.0
    else:
        assert (plan.pre_divide, plan.post_divide) == (divide_factors(world, dtype)
                                                       if world > 1 else (1.0, 1.0))
    # A one-rank group never gets AVG / PREMUL_SUM (it is a local copy; NCCL's AVG is not
    # trusted at size 1).
    if shard == 1:
        assert plan.scatter_op == "sum"
    if replica == 1:
        assert plan.replica_op == "sum"


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_choice_per_dtype(dtype):
    both = frozenset({"avg", "premul_sum"})
    plan = reduce_plan(both, dtype, 2, 2)
    if dtype == torch.float16:  # overflow-prone: pre-scale, never AVG (which may sum first)
        assert (plan.scatter_op, plan.scatter_factor, plan.replica_op) == ("premul_sum", 0.25, "sum")
        assert reduce_plan(frozenset({"avg"}), dtype, 2, 1) == ReducePlan(
            pre_divide=1.0, post_divide=2.0)
        assert reduce_plan(frozenset({"avg"}), dtype, 4, 1) == ReducePlan(
            pre_divide=2.0, post_divide=2.0)
    else:
        assert plan == ReducePlan(scatter_op="avg", replica_op="avg")
    assert reduce_plan(both, dtype, 1, 1) == ReducePlan()
    assert reduce_plan(frozenset({"premul_sum"}), dtype, 1, 4) == ReducePlan(
        replica_op="premul_sum", replica_factor=0.25)


def test_capabilities_declare_exact_ops_and_refuse_unknown_names():
    caps = Capabilities(exact_reduce_ops=frozenset({"avg"}))
    assert caps.describe()["exact_reduce_ops"] == ["avg"]
    assert Capabilities().exact_reduce_ops == frozenset()
    with pytest.raises(ShardkitError, match="exact_reduce_ops names \\['mean'\\]"):
        Capabilities(exact_reduce_ops=frozenset({"mean"}))
    # gloo's AVG is itself a sum then a divide (nothing saved), XLA's AVG is unreliable, and
    # xccl documents no exactness: they declare none.
    for backend in (CPUBackend, XLABackend, XPUBackend):
        assert backend.capabilities.exact_reduce_ops == frozenset()


class _Declares(CPUBackend):
    name = "declares-both"
    capabilities = dataclasses.replace(CPUBackend.capabilities,
                                       exact_reduce_ops=frozenset({"avg", "premul_sum"}))


def test_backend_api_checks_the_op_and_its_factor():
    import torch.distributed as dist

    plain, both = CPUBackend(), _Declares()
    with pytest.raises(UnsupportedOperationError, match="'cpu' does not support reduce op 'avg'"):
        plain.torch_reduce_op("avg")
    assert both.torch_reduce_op("avg") is dist.ReduceOp.AVG
    with pytest.raises(UnsupportedOperationError, match="override torch_reduce_op"):
        both.torch_reduce_op("premul_sum", 0.5)  # torch builds PREMUL_SUM per vendor
    with pytest.raises(ShardkitError, match="needs a factor"):
        both.torch_reduce_op("sum", 0.5)
    assert both.exact_reduce_ops_for(torch.bfloat16) == {"avg", "premul_sum"}


def test_one_rank_groups_still_apply_the_op():
    class Scaling(_Declares):
        def torch_reduce_op(self, op, factor=None):
            return None  # never reaches torch.distributed on a one-rank group

    be, solo = Scaling(), Group(0, 1, (0,), None)
    out = torch.zeros(3)
    be.reduce_scatter_tensor(out, torch.tensor([2.0, 4.0, 6.0]), solo, op="premul_sum",
                             factor=0.5).wait()
    assert out.tolist() == [1.0, 2.0, 3.0]
    t = torch.tensor([2.0, 4.0])
    be.all_reduce(t, solo, op="premul_sum", factor=0.25).wait()
    assert t.tolist() == [0.5, 1.0]
    be.all_reduce(t, solo, op="avg").wait()
    assert t.tolist() == [0.5, 1.0]
