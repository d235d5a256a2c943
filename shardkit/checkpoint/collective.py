"""The few collectives checkpointing needs, through the Backend (so every rank raises together, never hangs)."""

from __future__ import annotations

import random
from typing import Any, Callable, Sequence

import torch

from ..runtime import DistContext, require_context
from .errors import CheckpointError


def context() -> DistContext:
    """The current shardkit context (initialising one from the environment if needed)."""
    return require_context()


def any_rank(ctx: DistContext, flag: bool) -> bool:
    """True on every rank when `flag` is True on at least one rank."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=ctx.device)
    ctx.backend.all_reduce(t, ctx.world)
    return bool(t.item())


def flags_any(ctx: DistContext, flags: Sequence[bool]) -> list[bool]:
    """Element-wise OR of a boolean vector across ranks."""
    if not flags:
        return []
    t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int64, device=ctx.device)
    ctx.backend.all_reduce(t, ctx.world)
    return [bool(v) for v in t.tolist()]


def shared_token(ctx: DistContext) -> int:
    """A random number chosen by rank 0 and known to every rank (names one save's temporary dir)."""
    t = torch.tensor([random.SystemRandom().getrandbits(48) if ctx.rank == 0 else 0],
                     dtype=torch.int64, device=ctx.device)
    ctx.backend.broadcast(t, 0, ctx.world)
    return int(t.item())


def merge_digests(ctx: DistContext, digests: dict[int, str], count: int) -> list[str]:
    """Combine hex sha256 digests computed by different ranks (each index by exactly one) everywhere."""
    t = torch.zeros(max(count, 1), 32, dtype=torch.int64, device=ctx.device)
    for i, hexdigest in digests.items():
        t[i] = torch.tensor(list(bytes.fromhex(hexdigest)), dtype=torch.int64)
    ctx.backend.all_reduce(t, ctx.world)
    return [bytes(row).hex() for row in t.cpu().tolist()][:count]


def on_rank0(ctx: DistContext, what: str, fn: Callable[[], Any]) -> Any:
    """Run fn on rank 0 only; if it fails, every rank raises, so no rank waits in a later collective."""
    result, failure = None, None
    if ctx.rank == 0:
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - whatever it is, the other ranks must hear of it
            failure = exc
    if any_rank(ctx, failure is not None):
        # Every rank raises rank 0's words, so whichever rank's log is read names the cause.
        text = broadcast_text(ctx, str(failure) if isinstance(failure, CheckpointError)
                              else f"{what} failed on rank 0: {type(failure).__name__}: {failure}")
        if isinstance(failure, CheckpointError):
            raise failure
        raise CheckpointError(text) from failure
    return result


def broadcast_text(ctx: DistContext, text: str) -> str:
    """Rank 0's `text` on every rank (two small broadcasts: length, then UTF-8 bytes)."""
    data = text.encode()
    n = torch.tensor([len(data)], dtype=torch.int64, device=ctx.device)
    ctx.backend.broadcast(n, 0, ctx.world)
    buf = torch.zeros(int(n.item()), dtype=torch.uint8)
    if ctx.rank == 0 and data:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    buf = buf.to(ctx.device)
    ctx.backend.broadcast(buf, 0, ctx.world)
    return bytes(buf.cpu().tolist()).decode(errors="replace")
