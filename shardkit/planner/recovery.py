"""What fault tolerance across replica groups adds to a plan: the state a recovering rank receives.

When a replica group rejoins (shard(..., fault_tolerance=...)), each of its ranks is sent its
own rank's sharded parameters and optimizer state by a healthy group and holds the received copy
in host memory until it is loaded: one extra copy of the rank's persistent parameter and
optimizer bytes (the sender streams them; on an accelerator it first copies them to the host).
Where the compute device is the host, that copy sits beside the live state, so the plan's peak
includes it; on an accelerator it is host memory only (Plan.recovery_bytes says how much).
"""

from __future__ import annotations

import dataclasses

from ..errors import ShardkitError
from .result import Plan


def with_recovery(plan: Plan, device_type: str) -> Plan:
    """`plan` with its recovery copy: counted in the peak where the device is the host."""
    if plan.strategy != "HYBRID_SHARD":
        raise ShardkitError(f"fault_tolerant=True plans HYBRID_SHARD (replica groups that can "
                            f"fail and rejoin), got {plan.strategy}")
    copy = plan.persistent.get("params", 0) + plan.persistent.get("optimizer", 0)
    on_device = copy if device_type == "cpu" else 0
    return dataclasses.replace(plan, recovery_bytes=copy, peak_bytes=plan.peak_bytes + on_device)
