"""Single-process unit tests of the engine's pure helpers, on odd shapes and odd group sizes.

Buffer pool, gradient packing and copy-out (against a padding formula written out here), the
fp16 divide factors and group making (against a stand-in backend that records new_group calls).
No process group is started: these run in milliseconds and pin down the arithmetic that the
multi-process parity tests only see through final numbers.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import shardkit
from shardkit.errors import ShardkitError
from shardkit.handles import Group
from shardkit.sharding.step.buffers import BufferPool
from shardkit.sharding.step.collectives import copy_out, pack_grads
from shardkit.sharding.step.reduce_ops import divide_factors
from shardkit.sharding.setup.groups import GroupMaker, make_groups
from shardkit.sharding.step.param import ShardedParam
from shardkit.sharding.step.whole_view import RowParams
from shardkit.sharding.policies import ShardingStrategy

ODD_SHAPES = [(5, 3), (7,), (1,), (2, 1, 3)]  # 15, 7, 1, 6 elements: none divides evenly by 3 or 4
CPU = torch.device("cpu")


# ---- buffer pool ---------------------------------------------------------------------------------

def test_pool_reuses_a_returned_buffer_only_up_to_twice_the_request() -> None:
    """A kept buffer serves requests of half its size up to its size; smaller ones get fresh memory."""
    pool = BufferPool(enabled=True, max_buffers=4)
    big = pool.take(100, torch.float32, CPU)
    pool.give(big)
    again = pool.take(51, torch.float32, CPU)
    assert again.numel() == 51 and again.data_ptr() == big.data_ptr()
    pool.give(again)  # a view: the pool keeps its base, once
    small = pool.take(49, torch.float32, CPU)  # 100 > 2 * 49: must not take the big buffer
    assert small.data_ptr() != big.data_ptr()
    assert pool.take(100, torch.float32, CPU).data_ptr() == big.data_ptr()


def test_pool_keys_by_dtype_and_keeps_the_largest_buffers() -> None:
    """Buffers of another dtype are never handed out; past max_buffers the smallest is dropped."""
    pool = BufferPool(enabled=True, max_buffers=2)
    bufs = [pool.take(n, torch.float32, CPU) for n in (10, 30, 20)]
    for b in bufs:
        pool.give(b)
    assert pool.take(15, torch.float16, CPU).data_ptr() not in {b.data_ptr() for b in bufs}
    assert pool.take(15, torch.float32, CPU).data_ptr() == bufs[2].data_ptr()  # smallest fit: 20
    assert pool.take(15, torch.float32, CPU).data_ptr() == bufs[1].data_ptr()  # then 30
    assert pool.take(10, torch.float32, CPU).data_ptr() != bufs[0].data_ptr()  # 10 was dropped


def test_disabled_pool_always_allocates() -> None:
    """With the pool off (streams), every take is fresh memory and give keeps nothing."""
    pool = BufferPool(enabled=False, max_buffers=4)
    a = pool.take(8, torch.float32, CPU)
    pool.give(a)
    assert pool.take(8, torch.float32, CPU).data_ptr() != a.data_ptr()


# ---- pack_grads / copy_out against the padding formula -------------------------------------------

def _params(group_size: int, rank: int = 0) -> list[ShardedParam]:
    group = Group(rank, group_size, tuple(range(group_size)))
    backend = shardkit.get_backend("cpu")
    out = []
    for i, shape in enumerate(ODD_SHAPES):
        full = nn.Parameter(torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape))
        # The padded rows themselves (RowParams): a group without process groups has no mesh.
        out.append(ShardedParam([f"p{i}"], [], full, group, 1, CPU, CPU, torch.float32, backend,
                                RowParams()))
    return out


def _padded_rows(shape: tuple[int, ...], group_size: int) -> int:
    """Dim-0 rows after padding to a multiple of group_size (whole rows, as FSDP2's dim-0 chunks)."""
    return math.ceil(shape[0] / group_size) * group_size


def _rows_reference(fulls: list[torch.Tensor | None], group_size: int) -> torch.Tensor:
    """Each tensor zero-padded with whole dim-0 rows to a multiple of group_size, split per rank
    into equal row blocks, flattened, the params side by side."""
    blocks = []
    for t, shape in zip(fulls, ODD_SHAPES):
        padded = torch.zeros((_padded_rows(shape, group_size), *shape[1:]))
        if t is not None:
            padded[:shape[0]] = t
        blocks.append(padded.reshape(group_size, -1))
    return torch.cat(blocks, dim=1)


@pytest.mark.parametrize("group_size", [1, 3, 4, 7])
def test_each_rank_holds_whole_rows_with_the_parameters_dimensions(group_size: int) -> None:
    """Rank r's shard is rows [r*k, (r+1)*k) of the parameter (zero rows past its end), same ndim."""
    for rank in range(group_size):
        for p, shape in zip(_params(group_size, rank), ODD_SHAPES):
            k = _padded_rows(shape, group_size) // group_size
            full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
            want = torch.zeros((k, *shape[1:]))
            real = full[rank * k:(rank + 1) * k]
            want[:real.shape[0]] = real
            assert p.sharded.shape == want.shape and p.sharded.dim() == len(shape)
            assert torch.equal(p.sharded.detach(), want)


@pytest.mark.parametrize("group_size", [1, 3, 4, 7])
def test_pack_grads_lays_out_padded_rows(group_size: int) -> None:
    """Row r holds every parameter's r-th shard of the gradient, padding and missing grads as zeros."""
    params = _params(group_size)
    grads: list[torch.Tensor | None] = [torch.randn(s) for s in ODD_SHAPES]
    grads[2] = None
    packed = pack_grads(params, grads, torch.float32, CPU, group_size, pre_divide=1.0)
    assert torch.equal(packed, _rows_reference(grads, group_size))
    halved = pack_grads(params, grads, torch.float32, CPU, group_size, pre_divide=2.0)
    assert torch.allclose(halved, _rows_reference(grads, group_size) / 2)


@pytest.mark.parametrize("group_size", [1, 3, 4, 7])
def test_copy_out_restores_the_full_tensors_from_gathered_rows(group_size: int) -> None:
    """copy_out is the inverse of the layout: gathered rows give back the original values.

    Each target is the parameter's padded flat buffer (padded_numel elements); its first numel
    elements are the full tensor and the padding lands in the tail.
    """
    params = _params(group_size)
    fulls = [torch.randn(s) for s in ODD_SHAPES]
    targets = [torch.full((p.padded_numel,), float("nan")) for p in params]
    copy_out(params, _rows_reference(list(fulls), group_size).reshape(-1), targets, group_size)
    for p, got, want in zip(params, targets, fulls):
        assert p.padded_numel == _padded_rows(want.shape, group_size) * want[0].numel()
        assert torch.equal(got[:want.numel()].view(want.shape), want)


# ---- divide factors ------------------------------------------------------------------------------

@pytest.mark.parametrize("world,expected", [(1, (1, 1)), (2, (1, 2)), (4, (2, 2)), (6, (2, 3)),
                                            (7, (1, 7)), (12, (3, 4)), (16, (4, 4)), (18, (3, 6))])
def test_fp16_divides_by_the_largest_divisor_up_to_sqrt_world_first(world: int,
                                                                    expected: tuple[int, int]) -> None:
    """fp16: pre * post == world, pre the largest divisor <= sqrt(world); exact factors, no rounding."""
    pre, post = divide_factors(world, torch.float16)
    assert (pre, post) == expected and pre * post == world


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_other_dtypes_sum_first_and_divide_once(dtype: torch.dtype) -> None:
    """Every other dtype: no pre-division, one division by the world size after the sum."""
    assert divide_factors(12, dtype) == (1.0, 12.0)


# ---- group making --------------------------------------------------------------------------------

class RecordingBackend:
    """Stands in for a Backend: new_group records the ranks and answers like torch would for `me`."""

    def __init__(self, me: int) -> None:
        self.me = me
        self.calls: list[tuple[int, ...]] = []

    @property
    def collectives(self) -> "RecordingBackend":
        """Its own collective side, as a vendor's Backend is."""
        return self

    def new_group(self, ranks: list[int]) -> Group:
        """Record the call; the group rank is the position of `me`, or -1."""
        self.calls.append(tuple(ranks))
        return Group(ranks.index(self.me) if self.me in ranks else -1, len(ranks), tuple(ranks))


def _world(size: int, me: int) -> Group:
    return Group(me, size, tuple(range(size)))


@pytest.mark.parametrize("strategy", [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP])
def test_full_sharding_uses_the_world_and_no_replicas(strategy: ShardingStrategy) -> None:
    """FULL_SHARD and SHARD_GRAD_OP shard over the whole world and create no group."""
    be = RecordingBackend(me=2)
    world = _world(5, 2)
    assert make_groups(GroupMaker(be), world, strategy, None, 5) == (world, None) and be.calls == []


def test_no_shard_replicates_over_the_world() -> None:
    """NO_SHARD: a one-rank shard group of this rank, the world as replica group."""
    be = RecordingBackend(me=3)
    shard, replica = make_groups(GroupMaker(be), _world(5, 3), ShardingStrategy.NO_SHARD, None, 5)
    assert (shard.rank, shard.size, shard.ranks) == (0, 1, (3,)) and replica == _world(5, 3)


@pytest.mark.parametrize("world_size,k,me", [(6, 3, 4), (6, 2, 5), (9, 3, 0), (4, 4, 1)])
def test_hybrid_groups_are_blocks_and_strides(world_size: int, k: int, me: int) -> None:
    """HYBRID_SHARD: shard group = my block of k consecutive ranks, replica group = my stride-k column;
    every rank creates every group in the same order."""
    be = RecordingBackend(me=me)
    shard, replica = make_groups(GroupMaker(be), _world(world_size, me), ShardingStrategy.HYBRID_SHARD, k,
                                 world_size)
    block = me // k * k
    assert shard.ranks == tuple(range(block, block + k)) and shard.rank == me - block
    assert replica is not None
    assert replica.ranks == tuple(range(me % k, world_size, k)) and replica.rank == me // k
    blocks = [tuple(range(s, s + k)) for s in range(0, world_size, k)]
    columns = [tuple(range(o, world_size, k)) for o in range(k)]
    assert be.calls == [g for g in blocks + columns if len(g) > 1]


def test_hybrid_group_size_must_divide_the_world() -> None:
    """A shard group size that does not divide the world size is refused with a hint."""
    with pytest.raises(ShardkitError, match="multiple of the shard group size"):
        make_groups(GroupMaker(RecordingBackend(me=0)), _world(6, 0), ShardingStrategy.HYBRID_SHARD, 4, 6)
