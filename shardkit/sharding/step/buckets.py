"""How a unit's parameters are grouped into flat collectives: one per dtype, large ones alone.

A flat buffer holds one dtype, so a unit issues one all-gather (and one reduce-scatter) per dtype.
Packing costs a copy of every byte on each side of the collective: copy-out after the gather,
packing the gradients before the reduction. Where that copy costs about as much as the collective
itself (host memory: no copy engine, the same cores do both), a parameter of at least
`Capabilities.direct_collective_numel` elements gets a bucket of its own, marked direct: it is
gathered straight into its padded flat storage and reduced straight from its gradient, with no copy
on either side, at the price of one more collective call per such parameter.

The engine and the planner both bucket with `collective_buckets`, so predicted call counts are the
engine's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, Protocol, TypeVar

import torch


class _Sized(Protocol):
    numel: int


P = TypeVar("P", bound=_Sized)


@dataclass(frozen=True)
class Bucket(Generic[P]):
    """Parameters of one dtype that share a flat collective; `direct` ones hold exactly one."""

    dtype: torch.dtype
    params: list[P]
    direct: bool = False


def dtype_buckets(params: list[P], key: Callable[[P], torch.dtype]) -> dict[torch.dtype, list[P]]:
    """Group `params` by `key` in first-seen order."""
    out: dict[torch.dtype, list[P]] = {}
    for p in params:
        out.setdefault(key(p), []).append(p)
    return out


def collective_buckets(params: list[P], key: Callable[[P], torch.dtype],
                       direct_numel: int | None) -> list[Bucket[P]]:
    """Buckets for `params`: per dtype, one direct bucket per param of >= `direct_numel` elements
    (None: never), then one packed bucket of the rest."""
    out: list[Bucket[P]] = []
    for dtype, group in dtype_buckets(params, key).items():
        packed = []
        for p in group:
            if direct_numel is not None and p.numel >= direct_numel:
                out.append(Bucket(dtype, [p], direct=True))
            else:
                packed.append(p)
        if packed:
            out.append(Bucket(dtype, packed))
    return out
