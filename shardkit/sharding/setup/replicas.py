"""Replicas that really are replicas: compare (or make equal) the values ranks replicate.

shard() checks that every rank built the same model *structure* (fingerprint.py), not the same
values. A rank that built its model from another seed, or from none (the most common slip in a
training script), or ranks that are threads of one process racing on torch's one global RNG,
start with replicas that differ; under NO_SHARD or HYBRID_SHARD every replica then trains its
own model, with no error. So after shard() every replica of every parameter and buffer is equal,
or shard() said which one is not:

- What is replicated: each parameter's shard across the replica group (NO_SHARD: every rank;
  HYBRID_SHARD: the ranks holding the same rows) and every buffer across all ranks. Under
  FULL_SHARD / SHARD_GRAD_OP ranks own disjoint rows, which together are one model: nothing of
  a parameter is replicated there.
- Compare: tensors are packed per dtype into chunks and the group's first rank broadcasts its
  chunk; each rank compares its own with it (exact: no hash to collide, no rounding; +0.0 and
  -0.0 count as equal, a NaN as different). One all-gather of per-tensor flags then lets every
  rank raise the same error, naming the first differing tensor and the ranks that differ from
  the first. Costs one broadcast of the replicated bytes (for NO_SHARD, about half of what one
  step's gradient all-reduce sends) at shard() only.
- sync (FSDP1's sync_module_states): broadcast the first rank's value of every parameter before
  it is sharded and of every buffer, so the model is exactly rank 0's.

Dtypes a backend cannot reduce or broadcast (an int64 BatchNorm counter on XLA) travel as their
bytes, two to a float32 (exact below 2**24), through the host.
"""

from __future__ import annotations

from typing import Iterable

import torch

from ...backend import Backend
from ...errors import ShardkitError
from ...handles import Group, ReduceOp
from ..surface.module_api import get_state

CHUNK_ELEMENTS = 1 << 24  # small tensors packed into one compare broadcast (64 MiB of fp32)
ALONE_ELEMENTS = 1 << 20  # tensors at least this large are broadcast alone, not copied


def _as_bytes_f32(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    if raw.numel() % 2:
        raw = torch.cat([raw, raw.new_zeros(1)])
    halves = raw.view(-1, 2).to(torch.int32)
    return (halves[:, 0] + 256 * halves[:, 1]).to(torch.float32).to(device)


def _from_bytes_f32(encoded: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    halves = encoded.cpu().to(torch.int32)
    raw = torch.stack([halves % 256, halves // 256], dim=1).to(torch.uint8).reshape(-1)
    nbytes = like.numel() * like.element_size()
    return raw[:nbytes].view(like.dtype).view(like.shape)


def _portable(t: torch.Tensor, backend: Backend, device: torch.device) -> torch.Tensor:
    """`t` flat on `device` in a dtype the backend's collectives take (a view where it already is)."""
    if backend.devices.supports_dtype(t.dtype):
        return t.detach().to(device).reshape(-1)
    return _as_bytes_f32(t, device)


def broadcast_from_first(t: torch.Tensor, backend: Backend, group: Group,
                         device: torch.device) -> torch.Tensor:
    """Group rank 0's value of `t` (same shape, dtype and device as `t`); collective."""
    buf = _portable(t, backend, device).clone()  # the broadcast writes it
    backend.collectives.broadcast(buf, 0, group).wait()
    if backend.devices.supports_dtype(t.dtype):
        return buf.view(t.shape).to(t.device)
    return _from_bytes_f32(buf, t).to(t.device)


def _runs(sizes: list[int], dtypes: list[torch.dtype]) -> list[list[int]]:
    """Tensor indices grouped for one broadcast each: per dtype, small tensors packed together
    up to CHUNK_ELEMENTS, large ones alone (packing them would only copy them)."""
    runs: dict[torch.dtype, list[int]] = {}
    out: list[list[int]] = []
    for i, (n, dtype) in enumerate(zip(sizes, dtypes)):
        if n >= ALONE_ELEMENTS:
            out.append([i])
            continue
        run = runs.setdefault(dtype, [])
        if run and sum(sizes[j] for j in run) + n > CHUNK_ELEMENTS:
            out.append(run)
            run = runs[dtype] = []
        run.append(i)
    return out + [run for run in runs.values() if run]


def _differing(named: list[tuple[str, torch.Tensor]], backend: Backend, group: Group,
               device: torch.device) -> list[bool]:
    """Per tensor: whether this rank's value differs from group rank 0's (collective)."""
    flags = [False] * len(named)
    portable = [_portable(t, backend, device) for _, t in named]
    for run in _runs([x.numel() for x in portable], [x.dtype for x in portable]):
        mine = torch.cat([portable[i] for i in run]) if len(run) > 1 else portable[run[0]]
        # Rank 0 only sends (a broadcast leaves the source's values as they are); the others
        # receive into fresh memory and compare.
        first = mine if group.rank == 0 else torch.empty_like(mine)
        backend.collectives.broadcast(first, 0, group).wait()
        sizes = [portable[i].numel() for i in run]
        for i, a, b in zip(run, mine.split(sizes), first.split(sizes)):
            flags[i] = not torch.equal(a, b)
    return flags


def replica_mismatches(named: list[tuple[str, torch.Tensor]], backend: Backend, group: Group,
                       device: torch.device) -> list[tuple[str, list[int]]]:
    """(name, ranks whose value differs from the group's first rank's) per unequal tensor; collective."""
    if group.size == 1 or not named:
        return []
    mine = torch.tensor([float(f) for f in _differing(named, backend, group, device)],
                        dtype=torch.float32, device=device)
    everyone = torch.empty(group.size * mine.numel(), dtype=torch.float32, device=device)
    backend.collectives.all_gather_into_tensor(everyone, mine, group).wait()
    table = everyone.view(group.size, -1).cpu()
    return [(name, [group.ranks[r] for r in range(group.size) if table[r, i]])
            for i, (name, _) in enumerate(named) if table[:, i].any()]


def mismatch_error(what: str, found: list[tuple[str, list[int]]], group: Group) -> ShardkitError:
    """The error shard() raises when replicas differ: first tensor, ranks, count, the fix."""
    name, ranks = found[0]
    more = f" (and {len(found) - 1} more tensors)" if len(found) > 1 else ""
    return ShardkitError(
        f"ranks {list(group.ranks)} must hold the same {what} {name!r}, but ranks {ranks} hold "
        f"other values than rank {group.ranks[0]}{more}: each replica would train its own "
        "model. HINT: build "
        "the model from the same seed on every rank (torch.manual_seed(s) before constructing it; "
        "with ranks that are threads of one process, inside `with shardkit.seeded(s):`), or pass "
        "shard(..., sync_module_states=True) to copy rank 0's values to every rank")


def check_replicas(params: Iterable[tuple[str, torch.Tensor]], replica: Group | None,
                   buffers: Iterable[tuple[str, torch.Tensor]], world: Group, backend: Backend,
                   device: torch.device) -> None:
    """Raise on every rank if a replicated parameter shard or buffer differs between ranks."""
    if replica is not None:
        found = replica_mismatches(list(params), backend, replica, device)
        if replica.size < world.size:
            # Replica groups compare different rows: every rank must learn of any group's
            # mismatch, or the rest would go on into a collective nobody else joins.
            anywhere = torch.tensor([float(bool(found))], device=device)
            backend.collectives.all_reduce(anywhere, world, op=ReduceOp.MAX).wait()
            if anywhere.item() and not found:
                raise ShardkitError(
                    "another replica group holds differing values of a parameter (its ranks "
                    "name it): each replica would train its own model. HINT: build the model "
                    "from the same seed on every rank, or pass shard(..., "
                    "sync_module_states=True)")
        if found:
            raise mismatch_error("parameter", found, replica)
    found = replica_mismatches(list(buffers), backend, world, device)
    if found:
        raise mismatch_error("buffer", found, world)


def check_model_replicas(model: torch.nn.Module) -> None:
    """Collective: raise on every rank if a sharded model's replicas have drifted apart.

    shard() checks this once; call it again whenever something may have changed one rank's
    copy (a buffer updated on one rank only, a parameter edited outside the optimizer, a
    partial load). Costs one broadcast of the replicated bytes.
    """
    state = get_state(model)
    check_replicas([(sp.fqn, sp.local) for sp in state.iter_params()], state.replica_group,
                   list(model.named_buffers()), state.world, state.backend, state.device)
