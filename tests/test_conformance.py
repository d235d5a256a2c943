"""Every available registered backend passes the conformance suite at world sizes 1-4.

Each (backend, world size) is one spawn shared by all its checks; each check is its own test item.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import shardkit
from shardkit.testing import ConformanceCache, SkipCheck, conformance_cases, run_world
from shardkit_backends.cpu import CPUBackend

AVAILABLE = [st.name for st in shardkit.backend_statuses() if st.available]
_cache = ConformanceCache()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend,world_size,check", [
    pytest.param(*case, marks=pytest.mark.slow) if case[1] > 1 else case
    for case in conformance_cases(AVAILABLE)])
def test_backend_conforms(backend: str, world_size: int, check: str) -> None:
    """One conformance check of one available backend at one world size."""
    try:
        _cache.check(backend, world_size, check)
    except SkipCheck as exc:
        pytest.skip(str(exc))


def test_cpu_backend_is_among_the_checked() -> None:
    """The backend that runs everywhere is always in the parametrisation."""
    assert "cpu" in AVAILABLE


class MiswiredBackend(CPUBackend):
    """A backend with three classic bugs the suite must catch."""

    name = "miswired"

    def torch_reduce_op(self, op: str, factor: float | None = None) -> Any:
        # Silently maps every op it does not know to SUM, the way AVG goes wrong on some stacks.
        return super().torch_reduce_op(op if op in self.capabilities.reduce_ops else "sum")

    def all_reduce(self, tensor: torch.Tensor, group: shardkit.Group, op: str = "sum",
                   async_op: bool = False) -> shardkit.Work:
        """Reduces 'max' with 'sum'."""
        return super().all_reduce(tensor, group, "sum" if op == "max" else op, async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, group: shardkit.Group,
                  async_op: bool = False) -> shardkit.Work:
        """Always broadcasts from group rank 0."""
        return super().broadcast(tensor, 0, group, async_op)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_suite_catches_a_miswired_backend() -> None:
    """The checks fail exactly where the backend is wrong and pass everywhere else."""
    result = run_world(MiswiredBackend(), 2)
    assert result.failed_checks() == ["all_reduce", "broadcast", "new_group", "unsupported_op"]
    assert "all_reduce max" in result.failure("all_reduce")
    assert "broadcast from 1" in result.failure("broadcast")
    assert "broadcast from group rank 1" in result.failure("new_group")
    assert "op='avg'" in result.failure("unsupported_op")
    # Printed (a REPL shows the repr), the result is a pass/fail table, not a wall of None.
    shown = repr(result).splitlines()
    assert shown[0] == "conformance of 'miswired'" and shown[1].split() == ["check", "ws=2"]
    rows = dict(line.split() for line in shown[2:-1])
    assert rows == {name: "FAIL" if name in result.failed_checks() else "pass"
                    for name in rows} and len(rows) == len(result.per_rank[0])
    assert shown[-1] == f"{len(rows) - 4} passed, 4 failed, 0 skipped"


def test_report_table_marks_sizes_that_cannot_run_here() -> None:
    from shardkit.testing.conformance import ConformanceReport, WorldResult

    ran = WorldResult("x", 1, [{"context": None, "all_gather": "[rank 0] wrong"}])
    skipped = WorldResult("x", 8, [], skipped="'x' sees 1 device(s), fewer than 8 ranks")
    assert str(ConformanceReport([ran, skipped]).table()).splitlines() == [
        "conformance of 'x'",
        "check       ws=1    ws=8",
        "context     pass    skip",
        "all_gather  FAIL    skip",
        "1 passed, 1 failed, 2 skipped; world size 8 skipped: 'x' sees 1 device(s), fewer than "
        "8 ranks"]


class LyingAverager(CPUBackend):
    """Declares AVG and PREMUL_SUM exact, but AVG sums and bf16 PREMUL_SUM returns zeros."""

    name = "lying-averager"
    capabilities = dataclasses.replace(CPUBackend.capabilities,
                                       exact_reduce_ops=frozenset({"avg", "premul_sum"}))

    def torch_reduce_op(self, op: str, factor: float | None = None) -> Any:
        """AVG silently becomes SUM; PREMUL_SUM is done below as a scaled SUM."""
        return super().torch_reduce_op("sum" if op in ("avg", "premul_sum") else op)

    def reduce_scatter_tensor(self, output, input, group, op="sum", async_op=False, *,
                              factor=None):
        """PREMUL_SUM: right in fp32, zeros in bf16 (the NCCL bug this check exists for)."""
        if op == "premul_sum":
            input = input * (0.0 if input.dtype == torch.bfloat16 else factor)
        return super().reduce_scatter_tensor(output, input, group, op)

    def all_reduce(self, tensor, group, op="sum", async_op=False, *, factor=None):
        """Same lies as reduce_scatter_tensor."""
        if op == "premul_sum":
            tensor.mul_(0.0 if tensor.dtype == torch.bfloat16 else factor)
        return super().all_reduce(tensor, group, op)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_suite_catches_a_backend_whose_declared_exact_ops_are_wrong() -> None:
    """A declared AVG that sums, and a bf16 PREMUL_SUM that zeroes, fail exact_reduce_ops."""
    result = run_world(LyingAverager(), 2, checks=["exact_reduce_ops"])
    assert result.failed_checks() == ["exact_reduce_ops"]
    text = result.failure("exact_reduce_ops")
    for what in ("all_reduce avg torch.float32", "reduce_scatter avg torch.bfloat16",
                 "all_reduce premul_sum torch.bfloat16", "reduce_scatter premul_sum torch.bfloat16"):
        assert what in text
    assert "premul_sum torch.float32" not in text  # the fp32 pre-scaled sum is right
    assert "expected the mean over 2 ranks" in text


class ClobberingGather(CPUBackend):
    """Clears the output before gathering into it: right for a separate input buffer, wrong for
    the engine's in-place gather, whose input is a row of that output."""

    name = "cpu-clobbering-gather"

    def all_gather_into_tensor(self, output, input, group, async_op=False):
        """Zero `output`, then gather (reading an input that may just have been zeroed)."""
        output.zero_()
        return shardkit.Backend.all_gather_into_tensor(self, output, input, group, async_op=async_op)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_suite_catches_a_backend_that_breaks_the_engines_in_place_gather() -> None:
    """The plain all_gather check passes (separate input); the engine's call shape does not."""
    result = run_world(ClobberingGather(), 2, checks=["all_gather", "engine_call_shapes"])
    assert result.failed_checks() == ["engine_call_shapes"]
    assert "in-place all_gather torch.float32 (async_op=False)" in result.failure("engine_call_shapes")
