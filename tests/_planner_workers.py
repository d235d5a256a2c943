"""Per-rank workers for the planner tests: what the engine really sends and holds, per case.

Each spawn runs every case of its world size in-process (a spawn costs seconds); the test
process plans the same cases on the meta device and compares.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc

import torch
import torch.nn.functional as F
from torch import nn

import shardkit
from shardkit.demo.memory import measured_state_bytes
from shardkit.sharding import get_state

from _models import Block, TinyNet, batch

FROZEN = ("conv.weight", "blocks.0.fc1.bias", "norm.weight")  # in the root and inside a unit
MP = {"fp32": None, "bf16": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}}
BIG_WIDTH = 1024  # the memory model: ~5.3M params, >= 40 MB of state per rank at 2 ranks


def hybrid_sizes(world: int) -> list[int]:
    """The HYBRID_SHARD group sizes checked at this world size."""
    return {1: [1], 2: [1, 2], 3: [3], 4: [2]}[world]


def comm_cases(world: int) -> list[dict]:
    """Every (strategy, group, precision, frozen, offload) combination checked at `world` ranks."""
    out = []
    strategies = [("FULL_SHARD", None), ("SHARD_GRAD_OP", None), ("NO_SHARD", None)]
    strategies += [("HYBRID_SHARD", k) for k in hybrid_sizes(world)]
    for strategy, hybrid in strategies:
        # Frozen params change only what is reduced, so they ride along with mixed precision.
        for mp, frozen in (("fp32", False), ("bf16", True)):
            out.append({"strategy": strategy, "hybrid_group_size": hybrid, "mp": mp,
                        "frozen": frozen, "cpu_offload": False})
    out.append({"strategy": "FULL_SHARD", "hybrid_group_size": None, "mp": "bf16", "frozen": True,
                "cpu_offload": True})
    return out


def tiny(frozen: bool) -> nn.Module:
    """TinyNet (uneven sizes for 2, 3 and 4 ranks), optionally with FROZEN frozen."""
    torch.manual_seed(0)
    model = TinyNet()
    for name in FROZEN if frozen else ():
        model.get_parameter(name).requires_grad_(False)
    return model


def shard_kwargs(case: dict) -> dict:
    """The shard()/plan() keyword arguments a case stands for."""
    mp = MP[case["mp"]]
    return {"strategy": case["strategy"], "hybrid_group_size": case["hybrid_group_size"],
            "mixed_precision": shardkit.MixedPrecision(**mp) if mp else None,
            "cpu_offload": case["cpu_offload"],
            "auto_wrap_policy": shardkit.wrap.transformer_layers({Block})}


def _one_comm_case(rank: int, case: dict, **extra) -> list[dict]:
    model = shardkit.shard(tiny(case["frozen"]), **shard_kwargs(case), **extra)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    shardkit.comm_stats(model, reset=True)
    steps = []
    for step in range(2):  # the second step runs with the recorded order (prefetch on)
        x, y = batch(step, rank)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        steps.append(shardkit.comm_stats(model, reset=True))
    return steps


class Wide(nn.Module):
    """A stack of wide linear layers (one odd width) whose state dwarfs the process's noise."""

    def __init__(self, width: int = BIG_WIDTH) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(4)]
                                    + [nn.Linear(width, width + 3)])
        self.head = nn.Linear(width + 3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (batch, width) -> (batch, 4)."""
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def memory_cases() -> list[dict]:
    """Strategies (and offload) whose persistent memory is measured at 2 ranks."""
    return [{"strategy": s, "hybrid_group_size": k, "cpu_offload": off}
            for s, k, off in [("FULL_SHARD", None, False), ("SHARD_GRAD_OP", None, False),
                              ("NO_SHARD", None, False), ("HYBRID_SHARD", 1, False),
                              ("HYBRID_SHARD", 2, False), ("FULL_SHARD", None, True)]]


def memory_kwargs(case: dict) -> dict:
    """The shard()/plan() keyword arguments a memory case stands for."""
    return {"strategy": case["strategy"], "hybrid_group_size": case["hybrid_group_size"],
            "cpu_offload": case["cpu_offload"],
            "auto_wrap_policy": shardkit.wrap.ModuleListItems()}


def _return_large_frees_to_the_os() -> None:
    """Make glibc unmap every freed block of >= 64 KiB at once, so RSS follows what is allocated.

    Set in the running rank (mallopt) rather than through MALLOC_MMAP_THRESHOLD_, which glibc
    reads only when a process starts: ranks forked from shardkit.spawn's forkserver inherit the
    server's malloc settings, not the environment of the test that spawned them.
    """
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    m_mmap_threshold = -3  # glibc's M_MMAP_THRESHOLD; also turns off its dynamic threshold
    if libc.mallopt(m_mmap_threshold, 65536) != 1:
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed: RSS cannot be compared here")


def _one_memory_case(rank: int, case: dict) -> dict:
    """RSS from before building the model to after optimizer.step(), the pool cleared."""
    backend = shardkit.current_context().backend
    gc.collect()
    before = backend.memory_stats()["allocated"]
    torch.manual_seed(0)
    model = shardkit.shard(Wide(), **memory_kwargs(case))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(2, BIG_WIDTH, generator=g), torch.randint(0, 4, (2,), generator=g)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    # The engine keeps a few flat buffers for reuse between steps (state.pool, on devices
    # without streams); they are transient communication buffers, not persistent state.
    get_state(model).pool.clear()
    gc.collect()
    after = backend.memory_stats()["allocated"]
    out = {"rss_delta": after - before, "held": measured_state_bytes(opt)}
    del model, opt
    gc.collect()
    return out


RESHARD_CASES = [  # (reshard_after_forward, comm case) at 4 ranks
    (2, {"strategy": "FULL_SHARD", "hybrid_group_size": None, "mp": "fp32", "frozen": False,
         "cpu_offload": False}),
    (2, {"strategy": "FULL_SHARD", "hybrid_group_size": None, "mp": "bf16", "frozen": True,
         "cpu_offload": False}),
    ({"blocks.0": 2, "<root>": False}, {"strategy": "FULL_SHARD", "hybrid_group_size": None,
                                        "mp": "fp32", "frozen": False, "cpu_offload": False}),
]


def _reshard_int_cases(rank: int) -> list[list[dict]]:
    """Bytes per step under int reshard_after_forward (and a per-unit dict)."""
    return [_one_comm_case(rank, case, reshard_after_forward=value)
            for value, case in RESHARD_CASES]


DIRECT_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP")


def _direct_comm(rank: int, strategy: str) -> list[dict]:
    """Bytes and calls per step of Wide (1M-element weights: direct buckets on the cpu backend)."""
    model = shardkit.shard(Wide(), strategy=strategy, auto_wrap_policy=shardkit.wrap.ModuleListItems())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    shardkit.comm_stats(model, reset=True)
    g = torch.Generator().manual_seed(rank)
    steps = []
    for _ in range(2):
        x, y = torch.randn(2, BIG_WIDTH, generator=g), torch.randint(0, 4, (2,), generator=g)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        steps.append(shardkit.comm_stats(model, reset=True))
    return steps


def suite(rank: int, world: int) -> dict:
    """Every planner measurement at this world size, in one spawn."""
    out: dict = {"comm": [_one_comm_case(rank, c) for c in comm_cases(world)]}
    if world == 2:
        _return_large_frees_to_the_os()
        out["memory"] = [_one_memory_case(rank, c) for c in memory_cases()]
        # After the memory cases: memory freed before mallopt would be reused and hide growth.
        out["direct_comm"] = [_direct_comm(rank, s) for s in DIRECT_STRATEGIES]
    if world == 4:
        out["reshard_int"] = _reshard_int_cases(rank)
    return out


@functools.lru_cache(maxsize=None)
def spawn_suite(world: int) -> list[dict]:
    """Run `suite` on `world` ranks once per test session."""
    return shardkit.spawn(suite, world, world, threads_per_rank=1)
