"""Which reduce ops average a unit's gradients: the backend's exact AVG / PREMUL_SUM, or SUM + divide.

A pure function of the backend's exact ops, the dtype and the group sizes, so every combination
is tested without the hardware that has them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...handles import ReduceOp


@dataclass(frozen=True)
class ReducePlan:
    """How one gradient bucket becomes the mean over the data-parallel ranks."""

    scatter_op: str = ReduceOp.SUM  # the reduce-scatter over the shard group
    scatter_factor: float | None = None  # premul_sum's factor
    replica_op: str = ReduceOp.SUM  # the all-reduce across replica groups (HYBRID / NO_SHARD)
    replica_factor: float | None = None
    pre_divide: float = 1.0  # divide the packed input by this before the reduce-scatter
    post_divide: float = 1.0  # divide the reduced shard by this after the all-reduce


def divide_factors(world: int, dtype: torch.dtype) -> tuple[float, float]:
    """Split the 1/world averaging into a pre- and post-reduction factor.

    fp16 sums overflow easily, so it divides by about sqrt(world) before and the rest after;
    other dtypes sum first and divide once (exactly the mean's rounding).
    """
    if dtype != torch.float16 or world <= 1:
        return 1.0, float(world)
    pre = max(d for d in range(1, math.isqrt(world) + 1) if world % d == 0)
    return float(pre), float(world // pre)


def reduce_plan(exact_ops: frozenset[str], dtype: torch.dtype, shard_size: int,
                replica_size: int) -> ReducePlan:
    """Choose the ops averaging a `dtype` gradient over shard_size x replica_size ranks.

    - "avg" where exact, except for fp16: AVG inside the shard group then across replicas (a
      mean of equal-sized means is the mean); a group of one rank keeps "sum" (a local copy),
      as one vendor library's AVG is not trusted at size 1.
    - "premul_sum" with factor 1/ranks otherwise where exact, also for fp16: each input is
      scaled before it is summed, so the sum cannot overflow; applied on the first collective
      that spans more than one rank.
    - else "sum" and the engine divides (fp16 splits the divide around the sum).
    """
    world = shard_size * replica_size
    if world <= 1:
        return ReducePlan()
    if ReduceOp.AVG in exact_ops and dtype != torch.float16:
        return ReducePlan(scatter_op=ReduceOp.AVG if shard_size > 1 else ReduceOp.SUM,
                          replica_op=ReduceOp.AVG if replica_size > 1 else ReduceOp.SUM)
    if ReduceOp.PREMUL_SUM in exact_ops:
        if shard_size > 1:
            return ReducePlan(scatter_op=ReduceOp.PREMUL_SUM, scatter_factor=1.0 / world)
        return ReducePlan(replica_op=ReduceOp.PREMUL_SUM, replica_factor=1.0 / world)
    pre, post = divide_factors(world, dtype)
    return ReducePlan(pre_divide=pre, post_divide=post)
