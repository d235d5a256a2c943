"""The dim-0 (row) shard layout of one parameter: how far it is padded and what each rank owns.

A parameter of shape (d0, *rest) is split along dim 0: each rank of the shard group owns
`rows_per_rank` whole rows, a tensor of shape (rows_per_rank, *rest), so `p.dim()`, `p.ndim`
and the trailing sizes a training script looks at (weight-decay rules keyed on `p.dim() >= 2`,
fan-in scaling, matrix optimizers) are the unsharded model's. A 0-d parameter is one row of one
element and stays 0-d. Missing rows pad the end, which makes the rank-major concatenation of
the shards exactly the row-major flattening of the parameter followed by padding: the engine's
flat collectives stay flat, and rank r's shard is elements [r*shard_numel, (r+1)*shard_numel)
of the flattened, padded tensor, as it was when shards were 1-D (a checkpoint stores its valid
elements as that block of rows of the whole tensor, as FSDP2 does).

Pure integer arithmetic shared by the engine (ShardedParam) and the planner, so the bytes the
planner predicts are the bytes the engine allocates and sends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class ShardLayout:
    """One parameter's shard over one shard group."""

    shard_shape: tuple[int, ...]  # the local tensor: (rows_per_rank, *full_shape[1:]), () if 0-d
    rows_per_rank: int
    shard_numel: int  # elements each rank owns (padding included)
    padded_numel: int  # shard_numel * group size: the gathered flat buffer


def shard_layout(shape: Sequence[int] | int, group_size: int, alignment: int = 1) -> ShardLayout:
    """The row layout of a parameter of `shape` over `group_size` ranks.

    Each rank owns at least one row (so an empty parameter still has a shard). Its shard holds
    a multiple of `alignment` elements when fewer than `alignment` elements of extra rows get
    there (always for 1-D parameters, which lay out exactly as flat shards did); 0-d parameters
    are never aligned. An int `shape` is a 1-D parameter of that many elements.
    """
    dims = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
    if not dims:  # a 0-d tensor cannot hold more than its one element: no alignment
        return ShardLayout((), 1, 1, group_size)
    rows, rest = dims[0], dims[1:]
    row_numel = math.prod(rest)
    rows_per_rank = max(1, -(-rows // group_size))
    align = max(1, alignment)
    if row_numel and align > 1:
        step = align // math.gcd(align, row_numel)  # rows making a multiple of `align` elements
        aligned = -(-rows_per_rank // step) * step
        # Alignment is a speed preference, never worth more padding than the flat layout had
        # (under `align` elements a rank): wide rows of an awkward size stay unaligned.
        if (aligned - rows_per_rank) * row_numel < align:
            rows_per_rank = aligned
    shard_numel = rows_per_rank * row_numel
    return ShardLayout((rows_per_rank, *rest), rows_per_rank, shard_numel, shard_numel * group_size)
