"""The few collectives checkpointing needs, through the Backend (so every rank raises together, never hangs)."""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any, Callable, Sequence

import torch

from ..job.runtime import DistContext, require_context
from .errors import CheckpointError


def context() -> DistContext:
    """The current shardkit context (initialising one from the environment if needed)."""
    return require_context()


def any_rank(ctx: DistContext, flag: bool) -> bool:
    """True on every rank when `flag` is True on at least one rank."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=ctx.device)
    ctx.backend.collectives.all_reduce(t, ctx.world)
    return bool(t.item())


def flags_any(ctx: DistContext, flags: Sequence[bool]) -> list[bool]:
    """Element-wise OR of a boolean vector across ranks."""
    if not flags:
        return []
    t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int64, device=ctx.device)
    ctx.backend.collectives.all_reduce(t, ctx.world)
    return [bool(v) for v in t.tolist()]


def shared_token(ctx: DistContext) -> int:
    """A random number chosen by rank 0 and known to every rank (names one save's temporary dir)."""
    t = torch.tensor([random.SystemRandom().getrandbits(48) if ctx.rank == 0 else 0],
                     dtype=torch.int64, device=ctx.device)
    ctx.backend.collectives.broadcast(t, 0, ctx.world)
    return int(t.item())


def merge_digests(ctx: DistContext, digests: dict[int, str], count: int) -> list[str]:
    """Combine hex sha256 digests computed by different ranks (each index by exactly one) everywhere."""
    t = torch.zeros(max(count, 1), 32, dtype=torch.int64, device=ctx.device)
    for i, hexdigest in digests.items():
        t[i] = torch.tensor(list(bytes.fromhex(hexdigest)), dtype=torch.int64)
    ctx.backend.collectives.all_reduce(t, ctx.world)
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
    ctx.backend.collectives.broadcast(n, 0, ctx.world)
    buf = torch.zeros(int(n.item()), dtype=torch.uint8)
    if ctx.rank == 0 and data:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    buf = buf.to(ctx.device)
    ctx.backend.collectives.broadcast(buf, 0, ctx.world)
    return bytes(buf.cpu().tolist()).decode(errors="replace")


def agree(ctx: DistContext, what: str, values: dict[str, Any]) -> None:
    """Raise on every rank, naming each rank's values, when ranks called `what` with different arguments.

    One small all-gather of a digest; the values themselves travel only when they differ.
    """
    text = json.dumps({k: repr(v) for k, v in values.items()}, sort_keys=True)
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:6], "big")
    everyone = torch.empty(ctx.world_size, dtype=torch.int64, device=ctx.device)
    ctx.backend.collectives.all_gather_into_tensor(
        everyone, torch.tensor([digest], dtype=torch.int64, device=ctx.device), ctx.world).wait()
    if len(set(everyone.tolist())) == 1:
        return
    per_rank = [json.loads(t) for t in gather_texts(ctx, text)]
    keys = [k for k in values if len({r.get(k) for r in per_rank}) > 1]
    shown = "; ".join(f"{key}: " + ", ".join(f"rank {r} {v.get(key)}" for r, v in enumerate(per_rank))
                      for key in keys)
    raise CheckpointError(
        f"{what} was called with different arguments on different ranks ({shown}); every rank must "
        "pass the same ones, and nothing was written or read. HINT: derive the path from the step "
        "(f'ckpt/step-{step}'), not from the time or anything else that differs between ranks, or "
        "compute it on rank 0 and broadcast it")


def gather_texts(ctx: DistContext, text: str) -> list[str]:
    """Every rank's `text`, in rank order, on every rank (two all-gathers: lengths, then bytes)."""
    data = text.encode()
    sizes = torch.empty(ctx.world_size, dtype=torch.int64, device=ctx.device)
    ctx.backend.collectives.all_gather_into_tensor(
        sizes, torch.tensor([len(data)], dtype=torch.int64, device=ctx.device), ctx.world).wait()
    width = max(int(sizes.max().item()), 1)
    mine = torch.zeros(width, dtype=torch.uint8)
    if data:
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    everyone = torch.empty(ctx.world_size * width, dtype=torch.uint8, device=ctx.device)
    ctx.backend.collectives.all_gather_into_tensor(everyone, mine.to(ctx.device), ctx.world).wait()
    rows = everyone.cpu().view(ctx.world_size, width).tolist()
    return [bytes(row[:n]).decode(errors="replace") for row, n in zip(rows, sizes.tolist())]
