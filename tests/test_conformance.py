"""Every available registered backend passes the conformance suite at world sizes 1-4.

Each (backend, world size) is one spawn shared by all its checks; each check is its own test item.
"""

from __future__ import annotations

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

    def _torch_op(self, op: str) -> Any:
        # Silently maps every op it does not know to SUM, the way AVG goes wrong on some stacks.
        return super()._torch_op(op if op in self.capabilities.reduce_ops else "sum")

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
