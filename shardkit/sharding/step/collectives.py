"""Pure helpers around one unit's flat collectives: fused copy-in, copy-out and gradient packing
(the collectives themselves are comms.py's strategies; divide factors: reduce_ops).

Every flat buffer is laid out (group_size, unit_shard_numel): row r holds, param after param,
the r-th shard of each parameter. All-gather fills all rows from each rank's own row;
reduce-scatter leaves row `rank` summed over the group.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ...backend import Backend
from ...handles import Group
from .param import ShardedParam
from .trace import trace_range
from .traffic import CommStats


def factor_kwargs(factor: float | None) -> dict[str, float]:
    """`factor=` for a collective only when there is one: plugins written before it keep working."""
    return {} if factor is None else {"factor": factor}


def row_sizes(params: Sequence[ShardedParam]) -> list[int]:
    """Elements each parameter takes in one row of the unit's flat buffer (its shard size)."""
    return [p.shard_numel for p in params]


def copy_in(params: Sequence[ShardedParam], inp: torch.Tensor, sizes: Sequence[int]) -> None:
    """Cast and copy every shard into its columns of `inp` in one fused (foreach) copy."""
    shards = [p.shard_flat() for p in params]
    if len(shards) == 1:
        inp.copy_(shards[0])
        return
    # One foreach copy casts to the row's dtype on the way: the unit is cast once, not per
    # parameter through temporaries.
    torch._foreach_copy_(list(torch.split(inp, list(sizes))), shards)


def copy_out(params: Sequence[ShardedParam], output: torch.Tensor,
             targets: Sequence[torch.Tensor], group_size: int) -> None:
    """Scatter the gathered rows into each parameter's padded flat target (one fused copy).

    Each target holds `padded_numel` elements, i.e. (group_size, padded_numel / group_size)
    rank-major, exactly the columns of the parameter in every row, so padding lands in the
    targets' unused tail (group_size is the shard group's, or k after a reshard to k ranks).
    """
    rows = output.view(group_size, -1)
    outs = [t.view(group_size, -1) for t in targets]
    with trace_range("shardkit::copy_out"):
        if len(outs) == 1:
            outs[0].copy_(rows)
        else:
            torch.split_with_sizes_copy(rows, [o.shape[1] for o in outs], dim=1, out=outs)


def pack_grads(params: Sequence[ShardedParam], grads: Sequence[torch.Tensor | None],
               dtype: torch.dtype, device: torch.device, group_size: int, pre_divide: float,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy full gradients (zeros where None) into the (group_size, row) reduce-scatter input.

    One `_chunk_cat` casts to `dtype`, splits each grad into its per-rank shards, zero-pads them
    and lays them out rank-major: the whole unit in one kernel where the device has one.
    """
    row = sum(p.shard_numel for p in params)
    if out is None:
        out = torch.empty(group_size * row, dtype=dtype, device=device)
    inp = out.view(group_size, row)
    chunks = []
    for p, grad in zip(params, grads):
        if grad is None:  # an unused parameter reduces as zeros
            chunks.append(torch.zeros(p.padded_numel, dtype=dtype, device=device))
            continue
        flat = grad.reshape(-1)
        if p.numel and -(-p.numel // group_size) == p.shard_numel:
            chunks.append(flat)  # _chunk_cat pads the last shards exactly as the layout does
        else:  # aligned shards are wider than _chunk_cat's ceil(numel / group): pad by hand
            chunks.append(torch.nn.functional.pad(flat, (0, p.padded_numel - p.numel)))
    with trace_range("shardkit::pack_grads"):
        torch._chunk_cat(chunks, dim=0, num_chunks=group_size, out=inp)
    if pre_divide != 1.0:
        inp.div_(pre_divide)
    return inp


def grad_as_input(p: ShardedParam, grad: torch.Tensor | None, dtype: torch.dtype,
                  group_size: int, pre_divide: float) -> torch.Tensor | None:
    """A direct bucket's grad viewed as its own (group_size, shard) reduce input, or None where it
    cannot be (absent, another dtype, padded, not contiguous): then it is packed like the rest."""
    if (grad is None or grad.dtype != dtype or p.numel != p.padded_numel
            or not grad.is_contiguous()):
        return None
    inp = grad.view(group_size, p.shard_numel)
    if pre_divide != 1.0:
        inp.div_(pre_divide)
    return inp


def share_replicated_scalars(params: Sequence[ShardedParam], row: torch.Tensor,
                             group: Group | None, backend: Backend, stats: CommStats | None) -> None:
    """Give every rank of the shard group the reduced gradient of each replicated 0-d parameter.

    The reduce-scatter leaves such a gradient on shard rank 0 (the others' slots are zero), but
    every rank holds and steps the parameter (sharding/step/whole_view.py). One small sum over the
    group, to which the other ranks add exact zeros, hands out rank 0's value bit for bit, so the
    replicas stay identical (summing the gradient into every rank's slot instead would round
    differently per slot at 3+ ranks).
    """
    if group is None or group.size <= 1 or not any(p.replicated_scalar for p in params):
        return  # the per-step case: no 0-d parameter in this bucket
    where, offset = [], 0
    for p, size in zip(params, row_sizes(params)):
        if p.replicated_scalar:
            where.append(offset)
        offset += size
    index = torch.tensor(where, device=row.device)
    values = row.index_select(0, index)
    if stats is not None:
        stats.all_reduce(values.numel() * values.element_size(), group.size,
                         stats.crosses_node(group))
    backend.collectives.all_reduce(values, group, op="sum", async_op=False).wait()
    row.index_copy_(0, index, values)
