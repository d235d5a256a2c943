"""Collective-order verification (SHARDKIT_DEBUG=1 or shard(..., verify=True)).

Ranks that issue different collectives (an extra forward on one rank, a unit skipped by a branch)
otherwise pair up mismatched operations and hang, or silently mix tensors of equal size. With
verification on, the engine's backend gets a wrapped collective side (`backend.collectives`; the
device side is the backend's own): before each collective a rank publishes a
fingerprint of it (sequence number, op, element count, dtype, unit and phase) in the job's store
and compares it with every other member of the group. The first difference raises on both sides,
naming the collective each rank was about to issue. Off (the default), the engine uses the backend
itself: no wrapper, no cost.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch

from ...backend import Backend
from ...env_flags import DEBUG, env_flag
from ...errors import ShardkitError
from ...failure import where
from ...failure.watchdog import default_store_client
from ...handles import Group, ReduceOp, Work
from .collectives import factor_kwargs

ENV = DEBUG  # the one SHARDKIT_DEBUG, named in env_flags
_PREFIX = "shardkit/verify/"
_KEEP = 64  # fingerprints a rank keeps in the store (peers read them within a few collectives)
# Verified models made in this process so far. Every rank shards its models in the same order,
# so the n-th one is the same model everywhere: its number keeps two models' sequence counters
# (a teacher and a student, an EMA copy) from reading each other's keys.
_models_made = 0


def reset_counter() -> None:
    """Number verified models from 0 again, as a new process does (process_state.reset)."""
    global _models_made
    _models_made = 0


class CollectiveOrderError(ShardkitError):
    """Ranks issued different collectives; the message names the first difference on each side."""


def requested(verify: bool | None) -> bool:
    """True when shard(verify=...) or, if that is None, SHARDKIT_DEBUG asks for verification."""
    if verify is not None:
        return bool(verify)
    return env_flag(ENV)


def maybe_wrap(backend: Backend, verify: bool | None, timeout: datetime.timedelta) -> Backend:
    """The backend the engine should use: wrapped for verification if requested and possible."""
    if not requested(verify):
        return backend
    store = default_store_client()
    if store is None:
        if verify:
            raise ShardkitError("shard(verify=True) needs a multi-process job with a store (ranks "
                                "as processes, world size > 1); HINT: run under shardkit.spawn, "
                                "torchrun or shardkit launch")
        return backend
    global _models_made
    _models_made += 1
    return VerifyingBackend(backend, store, timeout,  # type: ignore[return-value]
                            f"{_PREFIX}model{_models_made}/")


class VerifyingBackend:
    """A Backend whose collective side checks each collective's order on every rank first; the rest is the backend's."""

    def __init__(self, backend: Backend, store: Any, timeout: datetime.timedelta,
                 prefix: str = _PREFIX) -> None:
        self._backend = backend
        self.collectives = VerifyingCollectives(backend.collectives, store, timeout, prefix)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    @property
    def verified_collectives(self) -> int:
        """How many collectives this rank has verified so far (all groups)."""
        return self.collectives.verified_collectives


class VerifyingCollectives:
    """A collective side that verifies each collective, then runs it on the side it wraps."""

    def __init__(self, side: Any, store: Any, timeout: datetime.timedelta, prefix: str) -> None:
        self._side = side
        self._store = store
        self._timeout = timeout
        self._prefix = prefix  # one per verified model: its own sequence numbers
        self._seq: dict[tuple[int, ...], int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._side, name)  # groups, barriers, reduce ops: not verified

    @property
    def verified_collectives(self) -> int:
        """How many collectives this rank has verified so far (all groups)."""
        return sum(self._seq.values())

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, group: Group,
                               async_op: bool = False) -> Work:
        """Verify, then all-gather."""
        self._verify("all_gather", input, group)
        return self._side.all_gather_into_tensor(output, input, group, async_op=async_op)

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, group: Group,
                              op: str = ReduceOp.SUM, async_op: bool = False, *,
                              factor: float | None = None) -> Work:
        """Verify, then reduce-scatter."""
        self._verify(f"reduce_scatter({op})", input, group)
        return self._side.reduce_scatter_tensor(output, input, group, op=op, async_op=async_op,
                                                   **factor_kwargs(factor))

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, group: Group,
                          async_op: bool = False) -> Work:
        """Verify, then all-to-all."""
        self._verify("all_to_all", input, group)
        return self._side.all_to_all_single(output, input, group, async_op=async_op)

    def all_reduce(self, tensor: torch.Tensor, group: Group, op: str = ReduceOp.SUM,
                   async_op: bool = False, *, factor: float | None = None) -> Work:
        """Verify, then all-reduce."""
        self._verify(f"all_reduce({op})", tensor, group)
        return self._side.all_reduce(tensor, group, op=op, async_op=async_op,
                                        **factor_kwargs(factor))

    def broadcast(self, tensor: torch.Tensor, src: int, group: Group,
                  async_op: bool = False) -> Work:
        """Verify, then broadcast."""
        self._verify(f"broadcast(from {src})", tensor, group)
        return self._side.broadcast(tensor, src, group, async_op=async_op)

    # ---- the check -------------------------------------------------------------------------
    def _verify(self, op: str, tensor: torch.Tensor, group: Group) -> None:
        if group.size < 2:
            return
        members = tuple(group.ranks)
        seq = self._seq.get(members, 0) + 1
        self._seq[members] = seq
        base = f"{self._prefix}{'-'.join(map(str, members))}/"
        me = group.ranks[group.rank]
        # An extra evaluation forward is the classic divergence: mark forwards under no_grad so
        # the very first collective of one tells it apart from a training forward.
        grad = "" if torch.is_grad_enabled() or where.current()[1] != "forward" else " (no_grad)"
        mine = f"{op} of {tensor.numel()} x {tensor.dtype} in {where.describe()}{grad}"
        store = self._store
        store.set(f"{base}{seq}/{me}", mine)
        store.set(f"{base}last/{me}", f"#{seq}: {mine}")
        if seq > _KEEP:
            store.delete_key(f"{base}{seq - _KEEP}/{me}")
        for peer in members:
            if peer == me:
                continue
            key = f"{base}{seq}/{peer}"
            try:
                store.wait([key], self._timeout)
            except Exception:  # noqa: BLE001 - the peer never got this far
                last = f"{base}last/{peer}"
                theirs = store.get(last).decode() if store.check([last]) else "none yet"
                raise CollectiveOrderError(
                    f"collective #{seq} of group {list(members)}: rank {me} issued {mine}, but "
                    f"rank {peer} issued no collective #{seq} within {self._timeout.total_seconds():g} s "
                    f"(its last: {theirs}). HINT: every rank must run the same forward and "
                    "backward passes over the same sharded units (an extra forward, or a unit "
                    "skipped by a branch on some ranks, breaks that)") from None
            theirs = store.get(key).decode()
            if theirs != mine:
                raise CollectiveOrderError(
                    f"ranks issued different collectives: collective #{seq} of group "
                    f"{list(members)} is {mine} on rank {me} but {theirs} on rank {peer}. HINT: "
                    "every rank must run the same forward and backward passes over the same "
                    "sharded units; an extra forward (e.g. evaluation under no_grad) or a unit "
                    "skipped by a branch on some ranks breaks that")
