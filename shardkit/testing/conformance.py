"""A conformance suite any backend plugin can run against itself.

    from shardkit.testing import run_conformance
    run_conformance("mybackend").raise_for_failures()

or, one pytest item per check (each world size is still a single spawn)::

    from shardkit.testing import ConformanceCache, SkipCheck, conformance_cases
    cache = ConformanceCache()

    @pytest.mark.parametrize("backend,world_size,check", conformance_cases(["mybackend"]))
    def test_conformance(backend, world_size, check):
        try:
            cache.check(backend, world_size, check)
        except SkipCheck as exc:  # fewer devices than ranks on this machine
            pytest.skip(str(exc))

Every expected value is computed on each rank from a formula, never by another collective. A check
collects its mismatches and raises only after its last collective, so one failing rank cannot
leave the others waiting in a collective it skipped.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import traceback
from dataclasses import dataclass, field
import functools
import itertools
import operator
from typing import Any, Callable, Iterable, Sequence

import torch
from typing_extensions import override

from ..backend import Backend
from ..capabilities import AttentionCall, Capabilities
from ..errors import ShardkitError, UnsupportedOperationError
from ..handles import Group
from ..job.runtime import DistContext, current_context
from ..job.selection import get_backend
from ..job.spawn import spawn

WORLD_SIZES = (1, 2, 3, 4)
LENGTHS = (1, 7, 13)  # per-rank element counts: odd, not powers of two
CANDIDATE_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
UNSUPPORTED_OPS = ("avg", "prod", "product", "band")


class CheckFailed(AssertionError):
    """A conformance check found values or behaviour that differ from the contract."""


@dataclass
class Checker:
    """What a check sees on one rank: the context, a shared scratch dir, and a mismatch list."""

    ctx: DistContext
    workdir: str
    spawned_rank: int = 0  # what spawn() was asked for (env vars are shared when ranks are threads)
    spawned_size: int = 1
    errors: list[str] = field(default_factory=list)

    @property
    def be(self) -> Backend:
        """The backend under test."""
        return self.ctx.backend

    @property
    def rank(self) -> int:
        """This rank in the world group."""
        return self.ctx.rank

    @property
    def size(self) -> int:
        """The world size."""
        return self.ctx.world_size

    def dtypes(self) -> list[torch.dtype]:
        """The float dtypes this backend says it supports."""
        return [d for d in CANDIDATE_DTYPES if self.be.devices.supports_dtype(d)]

    def put(self, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Copy host values to the backend's device in `dtype`."""
        return values.to(dtype).to(self.ctx.device)

    def blank(self, shape: int | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A NaN-filled device tensor, so entries a collective forgot to write stand out."""
        return torch.full(shape if isinstance(shape, tuple) else (shape,), float("nan"),
                          dtype=dtype, device=self.ctx.device)

    def expect_equal(self, actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
        """Record a mismatch unless `actual` equals `expected` (cast to actual's dtype) exactly."""
        got = actual.detach().cpu()
        want = expected.to(got.dtype)
        if got.shape != want.shape or not torch.equal(got, want):
            self.errors.append(f"{what}: expected {want.tolist()}, got {got.tolist()}")

    def expect_close(self, actual: torch.Tensor, expected: torch.Tensor, what: str,
                     rtol: float, atol: float) -> None:
        """Record a mismatch unless `actual` is within tolerance of `expected`."""
        got = actual.detach().cpu().double()
        if got.shape != expected.shape or not torch.allclose(got, expected.double(), rtol=rtol, atol=atol):
            diff = (got - expected.double()).abs().max().item() if got.shape == expected.shape else "shape"
            self.errors.append(f"{what}: max abs difference {diff} (rtol={rtol}, atol={atol})")

    def expect(self, condition: bool, what: str) -> None:
        """Record `what` as a failure when `condition` is false."""
        if not condition:
            self.errors.append(what)

    def expect_raises(self, exc_type: type[BaseException], fn: Callable[[], object], what: str,
                      must_mention: str | None = None) -> None:
        """Record a failure unless `fn()` raises `exc_type` (whose message names `must_mention`)."""
        try:
            fn()
        except exc_type as exc:
            if must_mention is not None and must_mention not in str(exc):
                self.errors.append(f"{what}: the error does not name {must_mention!r}: {exc}")
            return
        except BaseException as exc:  # noqa: BLE001 - the wrong exception is the finding
            self.errors.append(f"{what}: raised {type(exc).__name__} ({exc}), "
                               f"expected {exc_type.__name__}")
            return
        self.errors.append(f"{what}: nothing was raised, expected {exc_type.__name__}")


def total_of(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """The elementwise sum of the tensors, in order (what a "sum" collective must produce)."""
    return functools.reduce(operator.add, tensors)


def values(rank: int, n: int, offset: int = 0) -> torch.Tensor:
    """Rank-specific float64 values, exact in bfloat16 and in sums of up to 4 of them."""
    i = torch.arange(n, dtype=torch.float64)
    return torch.remainder(rank * 7 + i * 3 + offset, 11) - 5.5


CHECKS: dict[str, Callable[[Checker], None]] = {}


def _check(fn: Callable[[Checker], None]) -> Callable[[Checker], None]:
    CHECKS[fn.__name__.removeprefix("check_")] = fn
    return fn


@_check
def check_context(c: Checker) -> None:
    """The world group, device and static facts a backend reports are coherent."""
    be, world = c.be, c.ctx.world
    c.expect(world.size == c.spawned_size, f"world size {world.size}, spawned {c.spawned_size}")
    c.expect(world.rank == c.spawned_rank, f"world rank {world.rank}, spawned {c.spawned_rank}")
    c.expect(world.ranks == tuple(range(world.size)), f"world ranks {world.ranks}")
    c.expect(c.ctx.device.type == be.device_type, f"device {c.ctx.device} for {be.device_type}")
    c.expect(isinstance(be.capabilities, Capabilities), "capabilities is not a Capabilities")
    c.expect("sum" in be.capabilities.reduce_ops, "reduce_ops lacks 'sum', the engine's only op")
    json.dumps(be.capabilities.describe())
    c.expect(be.devices.supports_dtype(torch.float32), "float32 unsupported")
    for dtype in CANDIDATE_DTYPES + (torch.float16,):
        c.expect(isinstance(be.devices.supports_dtype(dtype), bool), f"supports_dtype({dtype}) not a bool")
    pg = be.collectives.process_group_backend()
    c.expect(isinstance(pg, str) and pg != "", f"process_group_backend() = {pg!r}")
    count = be.devices.device_count()
    c.expect(isinstance(count, int) and count >= 1, f"device_count() = {count!r} on a running backend")
    c.expect(type(be).is_available() is True, "is_available() is not True while running")
    c.expect(isinstance(type(be).requirement_hint(), str), "requirement_hint() is not a str")
    versions = type(be).versions()
    c.expect(all(isinstance(k, str) and isinstance(v, str) for k, v in versions.items()),
             f"versions() must map str to str, got {versions!r}")


@_check
def check_all_gather(c: Checker) -> None:
    """all_gather_into_tensor concatenates every rank's input in rank order, any length, 1-D and 2-D."""
    for dtype in c.dtypes():
        for n in LENGTHS:
            out = c.blank(c.size * n, dtype)
            c.be.collectives.all_gather_into_tensor(out, c.put(values(c.rank, n), dtype), c.ctx.world).wait()
            expected = torch.cat([values(r, n) for r in range(c.size)])
            c.expect_equal(out, expected, f"all_gather {dtype} n={n}")
        out = c.blank((c.size * 3, 5), dtype)
        c.be.collectives.all_gather_into_tensor(out, c.put(values(c.rank, 15).view(3, 5), dtype),
                                    c.ctx.world).wait()
        expected = torch.cat([values(r, 15).view(3, 5) for r in range(c.size)])
        c.expect_equal(out, expected, f"all_gather 2-D {dtype}")


@_check
def check_all_to_all(c: Checker) -> None:
    """all_to_all_single sends the i-th equal slice of the input to rank i, for the int8 payloads of
    quantized reductions (shardkit.Quantization) and for floats; async handles too."""
    n = 6
    codes = [torch.arange(c.size * n, dtype=torch.int64).remainder(251) + 3 * r
             for r in range(c.size)]
    for async_op in (False, True):
        out = torch.zeros(c.size * n, dtype=torch.uint8, device=c.ctx.device)
        mine = codes[c.rank].to(torch.uint8).to(c.ctx.device)
        c.be.collectives.all_to_all_single(out, mine, c.ctx.world, async_op=async_op).wait()
        expected = torch.cat([codes[r][c.rank * n:(c.rank + 1) * n] for r in range(c.size)])
        c.expect_equal(out, expected.to(torch.uint8), f"all_to_all uint8 (async_op={async_op})")
    out = c.blank(c.size * n, torch.float32)
    c.be.collectives.all_to_all_single(out, c.put(values(c.rank, c.size * n), torch.float32),
                           c.ctx.world).wait()
    expected = torch.cat([values(r, c.size * n)[c.rank * n:(c.rank + 1) * n]
                          for r in range(c.size)])
    c.expect_equal(out, expected, "all_to_all float32")


@_check
def check_engine_call_shapes(c: Checker) -> None:
    """The calls the engine itself makes (sharding/step/comms/), beyond the plain ones above:
    an in-place all-gather whose input is this rank's row of the output (sync and async), and a
    reduce-scatter whose input the engine overwrites and reuses right after wait() (it consumes
    its input: the buffer goes back to a pool for the next collective)."""
    n = 13
    for dtype in c.dtypes():
        for async_op in (False, True):
            out = c.blank(c.size * n, dtype)
            row = out[c.rank * n:(c.rank + 1) * n]
            row.copy_(c.put(values(c.rank, n), dtype))
            c.be.collectives.all_gather_into_tensor(out, row, c.ctx.world, async_op=async_op).wait()
            c.expect_equal(out, torch.cat([values(r, n) for r in range(c.size)]),
                           f"in-place all_gather {dtype} (async_op={async_op})")
        scratch = c.put(values(c.rank, c.size * n, offset=3), dtype)
        first, second = c.blank(n, dtype), c.blank(n, dtype)
        c.be.collectives.reduce_scatter_tensor(first, scratch, c.ctx.world, op="sum", async_op=True).wait()
        scratch.fill_(1.5)  # the pool hands the buffer straight to the next reduction
        c.be.collectives.reduce_scatter_tensor(second, scratch, c.ctx.world, op="sum").wait()
        total = total_of(values(r, c.size * n, offset=3) for r in range(c.size))
        c.expect_equal(first, total[c.rank * n:(c.rank + 1) * n],
                       f"reduce_scatter {dtype}: output changed when its consumed input was reused")
        c.expect_equal(second, torch.full((n,), 1.5 * c.size, dtype=torch.float64),
                       f"reduce_scatter {dtype} from a reused input buffer")


@_check
def check_reduce_scatter_sum(c: Checker) -> None:
    """reduce_scatter_tensor with 'sum' leaves rank r the sum of every input's r-th slice."""
    for dtype in c.dtypes():
        for n in LENGTHS:
            out = c.blank(n, dtype)
            inp = c.put(values(c.rank, c.size * n, offset=1), dtype)
            c.be.collectives.reduce_scatter_tensor(out, inp, c.ctx.world, op="sum").wait()
            total = total_of(values(r, c.size * n, offset=1) for r in range(c.size))
            c.expect_equal(out, total[c.rank * n:(c.rank + 1) * n],
                           f"reduce_scatter sum {dtype} n={n}")
            # `input` is consumed (Backend.reduce_scatter_tensor): a backend may reduce in place.


@_check
def check_all_reduce(c: Checker) -> None:
    """all_reduce with sum, max and min (those the backend lists) matches a local reduction."""
    reducers = {"sum": lambda s: s.sum(0), "max": lambda s: s.amax(0), "min": lambda s: s.amin(0)}
    for dtype in c.dtypes():
        for op, reduce in reducers.items():
            if op not in c.be.capabilities.reduce_ops:
                continue
            for n in LENGTHS:
                t = c.put(values(c.rank, n, offset=2), dtype)
                c.be.collectives.all_reduce(t, c.ctx.world, op=op).wait()
                stacked = torch.stack([values(r, n, offset=2) for r in range(c.size)])
                c.expect_equal(t, reduce(stacked), f"all_reduce {op} {dtype} n={n}")


@_check
def check_broadcast(c: Checker) -> None:
    """broadcast from every source rank, zero and non-zero, reaches every rank."""
    for dtype in c.dtypes():
        for src in range(c.size):
            n = LENGTHS[src % len(LENGTHS)]
            t = c.put(values(src, n, offset=3), dtype) if c.rank == src else c.blank(n, dtype)
            c.be.collectives.broadcast(t, src, c.ctx.world).wait()
            c.expect_equal(t, values(src, n, offset=3), f"broadcast from {src} {dtype}")


@_check
def check_barrier(c: Checker) -> None:
    """No rank leaves barrier() before every rank has entered it (seen through files)."""
    for round_ in range(2):
        # Later ranks arrive later, so a barrier that does not wait lets rank 0 through early.
        time.sleep(0.05 * c.rank)
        open(os.path.join(c.workdir, f"barrier{round_}-rank{c.rank}"), "w").close()
        c.be.collectives.barrier(c.ctx.world)
        arrived = [r for r in range(c.size)
                   if os.path.exists(os.path.join(c.workdir, f"barrier{round_}-rank{r}"))]
        c.expect(arrived == list(range(c.size)),
                 f"barrier round {round_}: left it when only ranks {arrived} had arrived")


def _subgroup_collectives(c: Checker, group: Group, members: list[int], label: str) -> None:
    c.expect(group.size == len(members), f"{label}: size {group.size} for ranks {members}")
    if c.rank not in members:
        c.expect(group.rank == -1 and not group.is_member, f"{label}: non-member rank {group.rank}")
        return
    c.expect(group.rank == members.index(c.rank) and group.is_member,
             f"{label}: group rank {group.rank}, expected {members.index(c.rank)}")
    t = c.put(values(c.rank, 7, offset=4), torch.float32)
    c.be.collectives.all_reduce(t, group, op="sum").wait()
    c.expect_equal(t, total_of(values(r, 7, offset=4) for r in members), f"{label}: all_reduce")
    out = c.blank(len(members) * 5, torch.float32)
    c.be.collectives.all_gather_into_tensor(out, c.put(values(c.rank, 5), torch.float32), group).wait()
    c.expect_equal(out, torch.cat([values(r, 5) for r in members]), f"{label}: all_gather")
    src = group.size - 1
    t = c.put(values(c.rank, 3), torch.float32) if group.rank == src else c.blank(3, torch.float32)
    c.be.collectives.broadcast(t, src, group).wait()
    c.expect_equal(t, values(members[src], 3), f"{label}: broadcast from group rank {src}")
    c.be.collectives.barrier(group)


@_check
def check_new_group(c: Checker) -> None:
    """Subgroups (even ranks, all but rank 0, everyone) run collectives among their members only."""
    layouts = {"even ranks": [r for r in range(c.size) if r % 2 == 0],
               "all ranks, given in reverse": list(reversed(range(c.size)))}
    if c.size > 1:
        layouts["ranks 1.."] = list(range(1, c.size))
    for label, ranks in layouts.items():
        group = c.be.collectives.new_group(ranks)  # every rank creates every group, in the same order
        # Groups are ordered by global rank, whatever order the ranks were given in.
        c.expect(group.ranks == tuple(sorted(ranks)), f"{label}: ranks {group.ranks} for {ranks}")
        _subgroup_collectives(c, group, sorted(ranks), label)


@_check
def check_async_handles(c: Checker) -> None:
    """async_op=True returns a handle whose wait() makes the result visible and completes it."""
    n = 9
    a = c.put(values(c.rank, n), torch.float32)
    b = c.put(values(c.rank, n, offset=5), torch.float32)
    gathered = c.blank(c.size * n, torch.float32)
    scattered = c.blank(n, torch.float32)
    works = {
        "all_reduce a": c.be.collectives.all_reduce(a, c.ctx.world, op="sum", async_op=True),
        "all_reduce b": c.be.collectives.all_reduce(b, c.ctx.world, op="sum", async_op=True),
        "all_gather": c.be.collectives.all_gather_into_tensor(gathered, c.put(values(c.rank, n), torch.float32),
                                                  c.ctx.world, async_op=True),
        "reduce_scatter": c.be.collectives.reduce_scatter_tensor(
            scattered, c.put(values(c.rank, c.size * n, offset=6), torch.float32), c.ctx.world,
            op="sum", async_op=True),
    }
    for label, work in works.items():
        c.expect(isinstance(work.is_completed(), bool), f"{label}: is_completed() is not a bool")
    for label, work in reversed(list(works.items())):  # waiting out of order must work too
        work.wait()
        c.expect(work.is_completed() is True, f"{label}: not completed after wait()")
        work.wait()  # a second wait is harmless
    c.expect_equal(a, total_of(values(r, n) for r in range(c.size)), "async all_reduce a")
    c.expect_equal(b, total_of(values(r, n, offset=5) for r in range(c.size)), "async all_reduce b")
    c.expect_equal(gathered, torch.cat([values(r, n) for r in range(c.size)]), "async all_gather")
    total = total_of(values(r, c.size * n, offset=6) for r in range(c.size))
    c.expect_equal(scattered, total[c.rank * n:(c.rank + 1) * n], "async reduce_scatter")


def _random(rank: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(1000 + rank), dtype=torch.float64)


@_check
def check_sum_then_divide_mean(c: Checker) -> None:
    """Summing with 'sum' and dividing by the world size equals the true mean (the engine's averaging)."""
    tolerances = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 2e-2}
    n = 37
    for dtype in c.dtypes():
        tol = tolerances[dtype]
        inputs = [_random(r, c.size * n).to(dtype) for r in range(c.size)]
        mean = torch.stack([x.double() for x in inputs]).mean(0)
        t = inputs[c.rank].clone().to(c.ctx.device)
        c.be.collectives.all_reduce(t, c.ctx.world, op="sum").wait()
        c.expect_close(t.div_(c.size), mean, f"all_reduce mean {dtype}", rtol=tol, atol=tol)
        out = c.blank(n, dtype)
        c.be.collectives.reduce_scatter_tensor(out, inputs[c.rank].to(c.ctx.device), c.ctx.world, op="sum").wait()
        c.expect_close(out.div_(c.size), mean[c.rank * n:(c.rank + 1) * n],
                       f"reduce_scatter mean {dtype}", rtol=tol, atol=tol)


EXACT_OP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _mean_inputs(rank: int, n: int) -> torch.Tensor:
    """Small integers whose mean over any number of ranks is an integer: exact in every dtype."""
    return torch.remainder(torch.arange(n, dtype=torch.float64), 5) + 1 + 2 * rank


@_check
def check_exact_reduce_ops(c: Checker) -> None:
    """Every op in capabilities.exact_reduce_ops averages exactly, for each dtype it is claimed for.

    "avg" must give the mean; "premul_sum" with factor 1/world the same pre-scaled sum. The engine
    trusts these for gradients, so a backend that sums instead, or zeroes (as bf16 PREMUL_SUM did
    on one vendor library with power-of-two factors), fails here.
    """
    declared = c.be.capabilities.exact_reduce_ops
    n = 7
    for dtype in EXACT_OP_DTYPES:
        if not c.be.devices.supports_dtype(dtype):
            continue
        claimed = c.be.collectives.exact_reduce_ops_for(dtype)
        c.expect(claimed <= declared, f"exact_reduce_ops_for({dtype}) = {sorted(claimed)} claims "
                 f"ops outside capabilities.exact_reduce_ops {sorted(declared)}")
        for op in sorted(claimed & declared):
            factor = 1.0 / c.size if op == "premul_sum" else None
            stacked = torch.stack([_mean_inputs(r, c.size * n) for r in range(c.size)])
            mean = stacked.mean(0)
            # 1/world is exact for powers of two; otherwise each pre-scaled input rounds once.
            tol = 0.0 if op == "avg" or c.size & (c.size - 1) == 0 else (
                1e-6 if dtype == torch.float32 else 2e-2)
            t = c.put(_mean_inputs(c.rank, c.size * n), dtype)
            c.be.collectives.all_reduce(t, c.ctx.world, op=op, factor=factor).wait()
            _expect_mean(c, t, mean, f"all_reduce {op} {dtype}", tol)
            out = c.blank(n, dtype)
            c.be.collectives.reduce_scatter_tensor(out, c.put(_mean_inputs(c.rank, c.size * n), dtype),
                                       c.ctx.world, op=op, factor=factor).wait()
            _expect_mean(c, out, mean[c.rank * n:(c.rank + 1) * n], f"reduce_scatter {op} {dtype}",
                         tol)


def _expect_mean(c: Checker, actual: torch.Tensor, mean: torch.Tensor, what: str,
                 tol: float) -> None:
    what = f"{what} (expected the mean over {c.size} ranks)"
    if tol == 0.0:
        c.expect_equal(actual, mean, what)
    else:
        c.expect_close(actual, mean, what, rtol=tol, atol=tol)


@_check
def check_unsupported_op(c: Checker) -> None:
    """A reduce op the backend does not list raises UnsupportedOperationError naming the backend whose collectives refuse it."""
    for op in UNSUPPORTED_OPS:
        if op in c.be.capabilities.reduce_ops | c.be.capabilities.exact_reduce_ops:
            continue
        t = c.put(values(c.rank, 4), torch.float32)
        c.expect_raises(UnsupportedOperationError,
                        lambda: c.be.collectives.all_reduce(t, c.ctx.world, op=op).wait(),
                        f"all_reduce op={op!r}", must_mention=c.be.collectives.name)
        c.expect_equal(t, values(c.rank, 4), f"all_reduce op={op!r} changed its tensor")
        out = c.blank(2, torch.float32)
        c.expect_raises(UnsupportedOperationError,
                        lambda: c.be.collectives.reduce_scatter_tensor(
                            out, c.put(values(c.rank, 2 * c.size), torch.float32), c.ctx.world,
                            op=op).wait(),
                        f"reduce_scatter op={op!r}", must_mention=c.be.collectives.name)


@_check
def check_reduce_scatter_size_mismatch(c: Checker) -> None:
    """reduce_scatter with input != output * world size raises ShardkitError instead of aborting."""
    for extra in (1, -1):
        out = c.blank(3, torch.float32)
        inp = c.put(values(c.rank, 3 * c.size + extra), torch.float32)
        c.expect_raises(ShardkitError,
                        lambda: c.be.collectives.reduce_scatter_tensor(out, inp, c.ctx.world, op="sum").wait(),
                        f"reduce_scatter input {inp.numel()} for output 3 x {c.size}")
    c.be.collectives.barrier(c.ctx.world)  # everyone is still alive and in step afterwards


@_check
def check_storage_round_trip(c: Checker) -> None:
    """free_storage/alloc_storage keep the tensor object and give back room for its shape."""
    t = c.put(values(c.rank, 11), torch.float32)
    if not c.be.capabilities.supports_storage_resize:
        c.expect_raises(UnsupportedOperationError, lambda: c.be.devices.free_storage(t),
                        "free_storage without supports_storage_resize")
        return
    nbytes = t.numel() * t.element_size()
    c.be.devices.free_storage(t)
    c.expect(t.untyped_storage().size() == 0, f"{t.untyped_storage().size()} bytes left after free")
    c.be.devices.free_storage(t)  # freeing twice is harmless
    c.expect(tuple(t.shape) == (11,), f"free_storage changed the shape to {tuple(t.shape)}")
    c.be.devices.alloc_storage(t)
    c.expect(t.untyped_storage().size() == nbytes,
             f"alloc_storage gave {t.untyped_storage().size()} bytes, expected {nbytes}")
    c.be.devices.alloc_storage(t)  # allocating an allocated tensor is harmless
    t.copy_(c.put(values(c.rank, 11, offset=7), torch.float32))
    c.expect_equal(t, values(c.rank, 11, offset=7), "values written after alloc_storage")


@_check
def check_streams_and_events(c: Checker) -> None:
    """Streams and events (real or null objects) support the calls the engine makes."""
    be, dev = c.be, c.ctx.device
    side, main = be.devices.new_stream(dev), be.devices.current_stream(dev)
    c.expect(side is not None and main is not None, "new_stream/current_stream returned None")
    event = be.devices.new_event()
    c.expect(event is not None, "new_event returned None")
    side.wait_stream(main)
    with be.devices.use_stream(side):
        t = c.put(values(c.rank, 6), torch.float32) * 2
        event.record(side)
    main.wait_event(event)
    event.wait(main)
    be.devices.record_stream(t, main)
    event.synchronize()
    side.synchronize()
    c.expect(bool(event.query()), "event not complete after synchronize()")
    be.devices.synchronize(dev)
    be.devices.synchronize()
    c.expect_equal(t, values(c.rank, 6) * 2, "work queued on a side stream")
    be.devices.compiler_barrier([t])
    be.devices.step_boundary()


@_check
def check_normalize_device(c: Checker) -> None:
    """normalize_device accepts None, an index, the type string and torch.device; rejects the rest."""
    be, local = c.be, c.ctx.local_rank
    home = be.devices.local_device(local)
    c.expect(home.type == be.device_type, f"local_device gave {home}")
    for arg in (None, be.device_type, torch.device(be.device_type)):
        got = be.devices.normalize_device(arg, local)
        c.expect(got == home, f"normalize_device({arg!r}) = {got}, expected {home}")
    for index_arg in (0, f"{be.device_type}:0", torch.device(be.device_type, 0)):
        got = be.devices.normalize_device(index_arg, local)
        c.expect(got.type == be.device_type and got.index in (0, None),
                 f"normalize_device({index_arg!r}) = {got}")
    other = "meta" if be.device_type != "meta" else "cpu"
    bad_args: tuple[Any, ...] = (-1, True, 1.5, other, torch.device(other))  # wrong on purpose
    for bad in bad_args:
        c.expect_raises(ShardkitError, lambda: be.devices.normalize_device(bad, local),
                        f"normalize_device({bad!r})")


@_check
def check_memory_stats(c: Checker) -> None:
    """memory_stats reports non-negative integer 'allocated' and 'peak' bytes."""
    for device in (c.ctx.device, None):
        stats = c.be.devices.memory_stats(device)
        for key in ("allocated", "peak"):
            value = stats.get(key)
            c.expect(isinstance(value, int) and value >= 0,
                     f"memory_stats({device})[{key!r}] = {value!r}")
    c.be.devices.reset_peak_memory(c.ctx.device)


@_check
def check_declared_facts(c: Checker) -> None:
    """A started backend agrees with the facts its class declares (the planner reads the class)."""
    declared = type(c.be).capabilities
    c.expect(c.be.capabilities == declared,
             "the instance's capabilities differ from the class's: the planner, which plans "
             "without starting a backend, reads the class's")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for dropout, masked, mask_grad, grouped in itertools.product((False, True), repeat=4):
            if mask_grad and not masked:
                continue
            for head_dim in (64, 128, 256):
                call = AttentionCall(dtype, dropout, masked, mask_grad, grouped, head_dim)
                runs, says = c.be.devices.runs_fused_attention(call), declared.fused_attention(call)
                c.expect(runs == says, f"runs_fused_attention({call}) is {runs} but "
                                       f"Capabilities.fused_attention says {says}")


CHECK_NAMES = tuple(CHECKS)


def run_checks(rank: int, names: Sequence[str], workdir: str,
               world_size: int | None = None) -> dict[str, str | None]:
    """Run the named checks on this rank (a spawn target); map each to None or its failure text."""
    ctx = current_context()
    if ctx is None:
        raise ShardkitError("run_checks runs on a rank started by shardkit.spawn; no shardkit "
                            "context exists here")
    size = world_size if world_size is not None else int(os.environ["WORLD_SIZE"])
    results: dict[str, str | None] = {}
    for name in names:
        checker = Checker(ctx, workdir, rank, size)
        try:
            CHECKS[name](checker)
            if checker.errors:
                raise CheckFailed("\n".join(checker.errors))
            results[name] = None
        except Exception as exc:  # noqa: BLE001 - every failure becomes a report line
            results[name] = (str(exc) if isinstance(exc, CheckFailed)
                             else "".join(traceback.format_exception(exc)))
    return results


def max_world_size(backend: Backend) -> int | None:
    """Largest world size one machine can run (None: unlimited, ranks share the host)."""
    return backend.max_local_ranks()


@dataclass(repr=False)
class WorldResult:
    """The outcome of every check at one world size: per check, per rank, None or failure text."""

    backend: str
    world_size: int
    per_rank: list[dict[str, str | None]]
    skipped: str | None = None

    def failure(self, check: str) -> str | None:
        """Return the failure text of `check` on every rank that failed it, or None."""
        lines = [f"[rank {r}] {res[check]}" for r, res in enumerate(self.per_rank) if res.get(check)]
        return "\n".join(lines) or None

    def failed_checks(self) -> list[str]:
        """Names of the checks that failed on any rank."""
        return [name for name in CHECK_NAMES if self.per_rank and self.failure(name)]

    def outcome(self, check: str) -> str:
        """"pass", "FAIL", "skip" (world size not runnable here) or "-" (not run) for one check."""
        if self.skipped:
            return "skip"
        if not self.per_rank or check not in self.per_rank[0]:
            return "-"
        return "FAIL" if self.failure(check) else "pass"

    @override
    def __repr__(self) -> str:
        return repr(ConformanceReport([self]))


@dataclass(repr=False)
class ConformanceReport:
    """Results of a conformance run over several world sizes; printed, a pass/fail table."""

    results: list[WorldResult]

    def table(self) -> str:
        """One row per check, one column per world size (pass / FAIL / skip), and the totals."""
        names = ([n for n in CHECK_NAMES if any(r.outcome(n) in ("pass", "FAIL")
                                                for r in self.results)] or list(CHECK_NAMES))
        backends = sorted({r.backend for r in self.results})
        width = max(len(n) for n in names) if names else 5
        lines = [f"conformance of {', '.join(map(repr, backends))}",
                 (f"{'check':<{width}}  " + "  ".join(f"ws={r.world_size:<3}"
                                                      for r in self.results)).rstrip()]
        counts = {"pass": 0, "FAIL": 0, "skip": 0}
        for name in names:
            cells = [r.outcome(name) for r in self.results]
            for cell in cells:
                counts[cell] = counts.get(cell, 0) + 1
            lines.append((f"{name:<{width}}  " + "  ".join(f"{c:<6}" for c in cells)).rstrip())
        lines.append(f"{counts['pass']} passed, {counts['FAIL']} failed, {counts['skip']} skipped"
                     + "".join(f"; world size {r.world_size} skipped: {r.skipped}"
                               for r in self.results if r.skipped))
        return "\n".join(lines)

    @override
    def __repr__(self) -> str:
        return self.table()

    def failures(self) -> dict[tuple[int, str], str]:
        """Map (world size, check) to failure text for every failed check."""
        return {(res.world_size, name): res.failure(name) or ""
                for res in self.results for name in res.failed_checks()}

    def raise_for_failures(self) -> None:
        """Raise CheckFailed listing every failure, if there is one."""
        failures = self.failures()
        if failures:
            raise CheckFailed("\n\n".join(f"world size {ws}, check {name}:\n{text}"
                                          for (ws, name), text in failures.items()))


def _resolve(backend: str | Backend | type[Backend]) -> Backend:
    if isinstance(backend, type) and issubclass(backend, Backend):
        return backend()
    return get_backend(backend)


def run_world(backend: str | Backend | type[Backend], world_size: int,
              checks: Iterable[str] | None = None) -> WorldResult:
    """Run the checks at one world size in one spawn of `world_size` processes."""
    be = _resolve(backend)
    names = tuple(checks) if checks is not None else CHECK_NAMES
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise ShardkitError(f"unknown conformance checks {unknown}; choose from {list(CHECK_NAMES)}")
    limit = max_world_size(be)
    if limit is not None and world_size > limit:
        return WorldResult(be.name, world_size, [],
                           skipped=f"{be.name!r} sees {limit} device(s), fewer than {world_size} ranks")
    # A name is re-resolved in each rank; an unregistered Backend object travels pickled.
    target = be.name if isinstance(backend, str) else be
    with tempfile.TemporaryDirectory(prefix="shardkit-conformance-") as workdir:
        per_rank = spawn(run_checks, world_size, names, workdir, world_size, backend=target,
                         threads_per_rank=1)
    return WorldResult(be.name, world_size, per_rank)


def run_conformance(backend: str | Backend | type[Backend],
                    world_sizes: Sequence[int] = WORLD_SIZES,
                    checks: Iterable[str] | None = None) -> ConformanceReport:
    """Run every check (or those named) at each world size, one spawn per size."""
    names = tuple(checks) if checks is not None else None
    return ConformanceReport([run_world(backend, ws, names) for ws in world_sizes])


def conformance_cases(backends: Iterable[str],
                      world_sizes: Sequence[int] = WORLD_SIZES) -> list[tuple[str, int, str]]:
    """(backend, world size, check) triples to parametrise a test over."""
    return [(b, ws, name) for b in backends for ws in world_sizes for name in CHECK_NAMES]


class ConformanceCache:
    """Runs each (backend, world size) once and answers per-check questions from the result."""

    def __init__(self) -> None:
        self._results: dict[tuple[str, int], WorldResult] = {}

    def result(self, backend: str, world_size: int) -> WorldResult:
        """Return the (cached) result of every check for `backend` at `world_size`."""
        key = (backend, world_size)
        if key not in self._results:
            self._results[key] = run_world(backend, world_size)
        return self._results[key]

    def check(self, backend: str, world_size: int, check: str) -> None:
        """Raise CheckFailed if `check` failed; raise SkipCheck if the size cannot run here."""
        result = self.result(backend, world_size)
        if result.skipped:
            raise SkipCheck(result.skipped)
        failure = result.failure(check)
        if failure:
            raise CheckFailed(f"{backend} at world size {world_size}, check {check}:\n{failure}")


class SkipCheck(Exception):
    """This world size cannot run on this machine (too few devices); a test runner should skip."""
