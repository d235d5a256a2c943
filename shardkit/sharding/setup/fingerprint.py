"""Refuse to shard when ranks disagree about the model: one small all-gather of a digest first.

Ranks with different parameter names, shapes, dtypes, wrap plans or sharding options would issue
different collectives and hang (or silently mix tensors). shard() compares a SHA-256 digest of
what each rank is about to shard, before creating any group; only on a mismatch are the full
descriptions exchanged, to say which facts differ on which ranks.
"""

from __future__ import annotations

import hashlib
from typing import Any

from ...errors import ShardkitError
from ...failure.watchdog import default_store_client
from ...handles import Group
from .plan import UnitPlan
from ..policies import ShardConfig

MAX_DIFFERENCES = 5
_PREFIX = "shardkit/model/"
_calls = 0


def reset_counter() -> None:
    """Count shard() calls from 0 again, as a new process does (process_state.reset)."""
    global _calls
    _calls = 0


def describe(units: list[UnitPlan], config: ShardConfig) -> list[str]:
    """One "key: value" line per fact every rank must agree on: the options and each parameter."""
    lines = [f"options: strategy {config.strategy.name}, hybrid_group_size "
             f"{config.hybrid_group_size}, prefetch {config.prefetch}, {config.mixed_precision}, "
             f"{config.quantization}"]
    for unit in units:
        for plan in unit.params:
            p = plan.param
            lines.append(f"param {' = '.join(plan.fqns)}: unit {unit.name or '<root>'!r}, shape "
                         f"{tuple(p.shape)}, {p.dtype}, requires_grad={p.requires_grad}")
    return lines


def check_same_model(lines: list[str], world: Group) -> None:
    """Raise a ShardkitError listing the first differences if any rank describes another model.

    The digests travel through the job's store, not the device: no collective, no device memory,
    nothing to compile. The full descriptions are exchanged only on a mismatch. Jobs without a
    store (one rank, ranks as threads of one process) skip the check.
    """
    global _calls
    store = default_store_client() if world.size > 1 else None
    if store is None:
        return
    _calls += 1  # every rank calls shard() in the same order: the n-th calls compare
    base = f"{_PREFIX}{_calls}/"
    text = "\n".join(lines)
    store.set(f"{base}digest/{world.rank}", hashlib.sha256(text.encode()).hexdigest())
    digests = _gather(store, f"{base}digest/", world)
    if len(set(digests)) == 1:
        return
    store.set(f"{base}text/{world.rank}", text)
    texts = [t.split("\n") for t in _gather(store, f"{base}text/", world)]
    raise ShardkitError(mismatch_message(texts))


def _gather(store: Any, prefix: str, world: Group) -> list[str]:
    out = []
    for rank in range(world.size):
        try:
            store.wait([f"{prefix}{rank}"])
        except Exception as exc:  # the store's own timeout (shardkit's timeout)
            raise ShardkitError(f"rank {rank} did not reach shardkit.shard() in time ({exc}); "
                                "HINT: every rank must call shard() on its model") from exc
        out.append(store.get(f"{prefix}{rank}").decode())
    return out


def _differences(reference: list[str], other: list[str]) -> list[tuple[str, str]]:
    """(rank 0's line, the other rank's line) for each key whose value differs, in rank 0's order."""
    mine = dict(line.split(": ", 1) for line in reference)
    theirs = dict(line.split(": ", 1) for line in other)
    out = []
    for key in [*mine, *[k for k in theirs if k not in mine]]:
        a, b = mine.get(key), theirs.get(key)
        if a != b:
            out.append((f"{key}: {a}" if a is not None else f"no {key}",
                        f"{key}: {b}" if b is not None else f"no {key}"))
    return out


def mismatch_message(texts: list[list[str]]) -> str:
    """Say which ranks agree with rank 0 and, for the others, the first differing facts."""
    reference = texts[0]
    differing = [r for r, t in enumerate(texts) if t != reference]
    agree = [r for r in range(len(texts)) if r not in differing]
    parts = [f"ranks disagree about the model given to shardkit.shard(): ranks {agree} have one "
             f"model, ranks {differing} another. First differences:"]
    for rank in differing:
        for a, b in _differences(reference, texts[rank])[:MAX_DIFFERENCES]:
            parts.append(f"  rank 0: {a}\n  rank {rank}: {b}")
    parts.append("HINT: every rank must build the same model (same names, shapes, dtypes, frozen "
                 "parameters) and call shard() with the same strategy, auto_wrap_policy and "
                 "options; build it from the same config and seed on every rank")
    return "\n".join(parts)
