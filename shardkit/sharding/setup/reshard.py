"""`reshard_after_forward` per unit: True, False, or an int k (keep a 1/k slice; ZeRO++ hpZ).

With an int k (1 < k < N, k dividing the shard-group size N) each rank keeps, after forward, the
1/k slice of every padded unsharded parameter that belongs to its position inside its block of k
consecutive shard-group ranks; backward then all-gathers inside that k-rank group instead of
the whole shard group. k == N is the same as True and k == 1 the same as False, so values are
normalised to True, False or an int strictly between 1 and N.

The root unit is the exception to the strategy's default: where that default frees a unit after
forward (FULL_SHARD, HYBRID_SHARD), the root keeps its gathered parameters for backward, as
FSDP2's root does: backward starts in the root's own layers (the output head), so freeing them
after forward only to gather them again at once cost a whole extra all-gather of the root per
step (GPT-2 small at 2 ranks: 712 -> 637 MB sent per rank per step) and saved no memory at the
peak (the same 2226 MB per rank; benchmarks/README.md). After a forward under no_grad, where no
backward follows, the root frees them as before. A value the user gives for the root wins.
"""

from __future__ import annotations

from typing import Callable, Mapping, Union

from torch import nn

from ...errors import ShardkitError
from ...handles import Group
from .groups import GroupMaker, this_ranks_group
from .plan import UnitPlan
from ..policies import ShardConfig, ShardingStrategy

Reshard = Union[bool, int, None]
ReshardSpec = Union[Reshard, Mapping[str, Reshard], Callable[[str, nn.Module], Reshard]]


def unit_label(name: str) -> str:
    """How units are named to users: the module path, "<root>" for the root."""
    return name or "<root>"


def _normalise(value: Reshard, where: str, config: ShardConfig, n: int,
               root: bool = False) -> bool | int:
    if value is None:
        return False if root_keeps_by_default(value, root, config) else config.reshard_after_forward
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


def root_keeps_by_default(value: Reshard, root: bool, config: ShardConfig) -> bool:
    """True for the root unit left to the default under a strategy that frees units after forward."""
    return root and value is None and config.reshard_after_forward is True


def _given(spec: ReshardSpec, units: list[UnitPlan]) -> list[Reshard]:
    """The value `spec` gives each unit, before normalising (None: the default)."""
    names = [unit_label(u.name) for u in units]
    if isinstance(spec, Mapping):
        unknown = sorted(str(k) for k in spec if unit_label(str(k)) not in names)
        if unknown:
            raise ShardkitError(f"reshard_after_forward names unit(s) {unknown} that do not exist; "
                                f"HINT: the units are {names}")
        return [spec.get(u.name, spec.get(unit_label(u.name))) for u in units]
    if callable(spec):
        return [spec(unit_label(u.name), u.module) for u in units]
    return [spec] * len(units)


def resolve(spec: ReshardSpec, units: list[UnitPlan], config: ShardConfig,
            n: int) -> list[bool | int]:
    """One normalised value per unit plan: True, False or an int k with 1 < k < n."""
    per_unit = isinstance(spec, Mapping) or callable(spec)
    return [_normalise(v, f"[{unit_label(u.name)!r}]" if per_unit else "", config, n,
                       root=not u.name)
            for v, u in zip(_given(spec, units), units)]


def frees_without_backward(spec: ReshardSpec, units: list[UnitPlan],
                           config: ShardConfig) -> list[bool]:
    """Per unit: kept for backward only by the root's default, so freed after a no_grad forward."""
    return [root_keeps_by_default(v, not u.name, config) for v, u in zip(_given(spec, units), units)]


def make_reshard_groups(maker: GroupMaker, world: Group, shard_group: Group,
                        values: list[bool | int],
                        shard_groups: list[list[int]] | None = None) -> dict[int, Group]:
    """{k: this rank's k-rank group} for every int k in `values`; every rank calls this together.

    Each group is a block of k consecutive ranks of a shard group. `shard_groups` lists every
    shard group of the job (a user's mesh beside tensor parallelism: its data-parallel groups
    stride across the world); None: they are runs of consecutive world ranks (the world itself,
    or HYBRID's blocks), so the blocks are the runs of k consecutive world ranks.
    """
    groups = shard_groups if shard_groups is not None else [list(world.ranks)]
    out: dict[int, Group] = {}
    for k in sorted({v for v in values if not isinstance(v, bool)}):  # k >= 2 (resolve)
        out[k] = this_ranks_group(maker, world, [ranks[start:start + k] for ranks in groups
                                                 for start in range(0, len(ranks), k)])
        # Position inside the block == rank inside the group: the slice this rank keeps.
        assert out[k].rank == shard_group.rank % k, (out[k], shard_group)
    return out
