"""Refuse to shard when ranks disagree about the model: one small all-gather of a digest first.

Ranks with different parameter names, shapes, dtypes, wrap plans or sharding options would issue
different collectives and hang (or silently mix tensors). shard() compares a SHA-256 digest of
what each rank is about to shard; only on a mismatch does it gather the full descriptions to say
which lines differ on which ranks.
"""

from __future__ import annotations

import hashlib

import torch

from ..backend import Backend
from ..errors import ShardkitError
from ..handles import Group
from .plan import UnitPlan
from .policies import ShardConfig

MAX_DIFFERENCES = 5


def describe(units: list[UnitPlan], config: ShardConfig) -> list[str]:
    """One "key: value" line per fact every rank must agree on: the options and each parameter."""
    lines = [f"options: strategy {config.strategy.name}, hybrid_group_size "
             f"{config.hybrid_group_size}, prefetch {config.prefetch}, {config.mixed_precision}"]
    for unit in units:
        for plan in unit.params:
            p = plan.param
            lines.append(f"param {' = '.join(plan.fqns)}: unit {unit.name or '<root>'!r}, shape "
                         f"{tuple(p.shape)}, {p.dtype}, requires_grad={p.requires_grad}")
    return lines


def _all_gather_bytes(data: bytes, backend: Backend, group: Group,
                      device: torch.device) -> list[bytes]:
    """Every rank's `data`, in rank order (two small collectives: lengths, then padded bytes)."""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = torch.empty(group.size, dtype=torch.int64, device=device)
    backend.all_gather_into_tensor(sizes, size, group).wait()
    sizes_list = sizes.cpu().tolist()
    longest = max(sizes_list)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
    everyone = torch.empty(group.size * longest, dtype=torch.uint8, device=device)
    backend.all_gather_into_tensor(everyone, mine.to(device), group).wait()
    rows = everyone.cpu().view(group.size, longest)
    return [bytes(rows[r, :n].tolist()) for r, n in enumerate(sizes_list)]


def check_same_model(lines: list[str], backend: Backend, group: Group,
                     device: torch.device) -> None:
    """Raise a ShardkitError listing the first differences if any rank describes another model."""
    if group.size < 2:
        return
    digest = hashlib.sha256("\n".join(lines).encode()).digest()
    digests = _all_gather_bytes(digest, backend, group, device)
    if len(set(digests)) == 1:
        return
    texts = [t.decode().split("\n") for t in _all_gather_bytes("\n".join(lines).encode(), backend,
                                                                 group, device)]
    raise ShardkitError(mismatch_message(texts))


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
