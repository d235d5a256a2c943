"""`reshard_after_forward` per unit: True, False, or an int k (keep a 1/k slice; ZeRO++ hpZ).

With an int k (1 < k < N, k dividing the shard-group size N) each rank keeps, after forward, the
1/k slice of every padded unsharded parameter that belongs to its position inside its block of k
consecutive shard-group ranks; backward then all-gathers inside that k-rank group instead of
the whole shard group. k == N is the same as True and k == 1 the same as False, so values are
normalised to True, False or an int strictly between 1 and N.
"""

from __future__ import annotations

from typing import Callable, Mapping, Union

from torch import nn

from ..errors import ShardkitError
from ..handles import Group
from .groups import GroupMaker
from .plan import UnitPlan
from .policies import ShardConfig, ShardingStrategy

Reshard = Union[bool, int, None]
ReshardSpec = Union[Reshard, Mapping[str, Reshard], Callable[[str, nn.Module], Reshard]]


def unit_label(name: str) -> str:
    """How units are named to users: the module path, "<root>" for the root."""
    return name or "<root>"


def _normalise(value: Reshard, where: str, config: ShardConfig, n: int) -> bool | int:
    if value is None:
        return config.reshard_after_forward  # the strategy's default
    if isinstance(value, bool):
        return value
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    if not isinstance(value, int):
        raise ShardkitError(f"reshard_after_forward{where} must be None, True, False or an int, got "
                            f"{value!r}; HINT: valid ints here are the divisors of the shard "
                            f"group size {n}: {divisors}")
    if config.strategy is ShardingStrategy.NO_SHARD:
        raise ShardkitError(f"reshard_after_forward{where}={value} needs a sharding strategy: under "
                            "NO_SHARD parameters are replicated and there is nothing to reshard. "
                            "HINT: use FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD, or pass "
                            "None/True/False")
    if value < 1 or n % value:
        raise ShardkitError(f"reshard_after_forward{where}={value} must divide the shard group size "
                            f"{n}; HINT: use one of {divisors} (or True / False)")
    if value == n:
        return True
    if value == 1:
        return False
    return value


def resolve(spec: ReshardSpec, units: list[UnitPlan], config: ShardConfig,
            n: int) -> list[bool | int]:
    """One normalised value per unit plan: True, False or an int k with 1 < k < n."""
    names = [unit_label(u.name) for u in units]
    if isinstance(spec, Mapping):
        unknown = sorted(str(k) for k in spec if unit_label(str(k)) not in names)
        if unknown:
            raise ShardkitError(f"reshard_after_forward names unit(s) {unknown} that do not exist; "
                                f"HINT: the units are {names}")
        raw = [spec.get(u.name, spec.get(unit_label(u.name))) for u in units]
    elif callable(spec):
        raw = [spec(unit_label(u.name), u.module) for u in units]
    else:
        raw = [spec] * len(units)
    per_unit = isinstance(spec, Mapping) or callable(spec)
    return [_normalise(v, f"[{label!r}]" if per_unit else "", config, n)
            for v, label in zip(raw, names)]


def make_reshard_groups(maker: GroupMaker, world: Group, shard_group: Group,
                        values: list[bool | int]) -> dict[int, Group]:
    """{k: this rank's k-rank group} for every int k in `values`; every rank calls this together.

    Shard groups are runs of consecutive world ranks (the world itself, or HYBRID's blocks), so
    the blocks of k consecutive shard-group ranks are the runs of k consecutive world ranks.
    """
    me = world.ranks[world.rank]
    out: dict[int, Group] = {}
    for k in sorted({v for v in values if not isinstance(v, bool)}):
        for start in range(0, world.size, k):
            group = maker.new_group(list(world.ranks[start:start + k]))
            if me in group.ranks:
                out[k] = group
        # Position inside the block == rank inside the group: the slice this rank keeps.
        assert out[k].rank == shard_group.rank % k, (out[k], shard_group)
    return out
