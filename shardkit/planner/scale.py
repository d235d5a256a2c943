"""`shardkit plan --step-time`: predicted seconds per step from 8 to 1,024 ranks, as a table."""

from __future__ import annotations

from typing import Any

from torch import nn

from .build import plan
from .steptime import StepTime, Topology, UnitTimes, step_time


def scale_table(model: nn.Module, world_sizes: list[int], topology: Topology,
                forward_s: float, backward_s: float, optimizer_s: float = 0.0,
                **options: Any) -> list[StepTime]:
    """step_time at each world size: same per-rank batch (compute per rank stays), the plan's
    collectives at that size. `options` are shardkit.plan()'s."""
    rows = []
    for world in world_sizes:
        p = plan(model, world, **options)
        rows.append(step_time(p, UnitTimes.split(p, forward_s, backward_s, optimizer_s), topology))
    return rows


def scale_text(rows: list[StepTime], topology: Topology) -> str:
    """The table: per world size, compute, collectives, and the step without and with overlap."""
    intra, inter = topology.intra, topology.inter
    lines = [f"step time per rank (alpha-beta model; {topology.ranks_per_node} ranks per node, "
             f"inside: {intra.name} {intra.bandwidth / 1e9:.0f} GB/s {intra.latency_s * 1e6:.0f} us, "
             f"between: {inter.name} {inter.bandwidth / 1e9:.1f} GB/s {inter.latency_s * 1e6:.0f} us)",
             f"{'ranks':>6} {'compute s':>10} {'collectives s':>14} {'no overlap s':>13} "
             f"{'overlapped s':>13} {'exposed':>8}"]
    for r in rows:
        exposed = r.exposed_communication_s / r.overlapped_s if r.overlapped_s else 0.0
        lines.append(f"{r.world_size:>6} {r.compute_s:>10.3f} {r.communication_s:>14.3f} "
                     f"{r.serial_s:>13.3f} {r.overlapped_s:>13.3f} {exposed:>8.0%}")
    lines.append("exposed: the share of the overlapped step spent waiting on collectives. Not "
                 "modelled: contention, small-message protocols, stragglers (see "
                 "shardkit/planner/steptime.py).")
    return "\n".join(lines)
