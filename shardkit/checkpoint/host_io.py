"""DCP-format checkpoint files written and read without a torch process group (host copies of the shards).

Some backends' ranks have no torch.distributed process group for DCP to coordinate through (their
ranks may be threads of one process, which a process-global default group cannot serve). They still
write the same files as ``dcp.save``: every rank runs DCP's own planner and ``FileSystemWriter`` on
host copies of its chunks (``__<rank>_0.distcp``), leaves its plan and write results in the
checkpoint directory, and, once every rank has written, rank 0 builds the global ``.metadata`` from
them with DCP's planner and writer and removes them. Loading reads each rank's overlap with
``dcp.load(no_dist=True)`` into host tensors and copies them onto the device.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from typing_extensions import override

from . import collective
from .dcp_io import (FlatChunk, FlatChunkSavePlanner, SaveItem, _MetadataUnpickler, load_chunks,
                     with_copies)
from .errors import CheckpointError

PLAN_FILE = ".shardkit_plan_rank{rank}"

# What a rank's SavePlan and WriteResults contain beyond DCP's metadata types.
_PLAN_GLOBALS = {
    ("torch.distributed.checkpoint.planner", name)
    for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")
} | {("torch.distributed.checkpoint.storage", "WriteResult"),
     ("torch.distributed.checkpoint.filesystem", "_StoragePrefix")}


class _PlanUnpickler(_MetadataUnpickler):
    @override
    def find_class(self, module: str, name: str) -> Any:
        """DCP's plan types as well as its metadata types; everything else is refused."""
        if (module, name) in _PLAN_GLOBALS:
            return pickle.Unpickler.find_class(self, module, name)
        return super().find_class(module, name)


def write_rank(directory: str, chunks: dict[str, SaveItem], rank: int) -> None:
    """Write this rank's host chunks as DCP's ``__<rank>_0.distcp`` and leave its plan for write_metadata."""
    planner = FlatChunkSavePlanner()
    writer = FileSystemWriter(directory, single_file_per_rank=True, sync_files=True)
    planner.set_up_planner(chunks, None, rank == 0)
    # use_collectives=False: DCP names this rank's file __<rank>_0.distcp without a global plan.
    writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=False)
    plan = writer.prepare_local_plan(planner.create_local_plan())
    planner.finish_plan(plan)
    results = writer.write_data(plan, planner).wait()
    path = os.path.join(directory, PLAN_FILE.format(rank=rank))
    with open(path, "wb") as f:
        pickle.dump((plan, results), f)
        f.flush()
        os.fsync(f.fileno())


def write_metadata(directory: str, world_size: int) -> None:
    """Build DCP's global ``.metadata`` from every rank's plan file (then removed), as dcp.save would."""
    plans, results = [], []
    for rank in range(world_size):
        path = os.path.join(directory, PLAN_FILE.format(rank=rank))
        with open(path, "rb") as f:
            plan, written = _PlanUnpickler(io.BytesIO(f.read())).load()
        plans.append(plan)
        results.append(written)
    planner = FlatChunkSavePlanner()
    planner.set_up_planner({}, None, True)
    _, metadata = planner.create_global_plan(plans)
    writer = FileSystemWriter(directory, single_file_per_rank=True, sync_files=True)
    writer.set_up_storage_writer(True)
    writer.finish(metadata, results)
    for rank in range(world_size):
        os.remove(os.path.join(directory, PLAN_FILE.format(rank=rank)))


def save_chunks_from_host(directory: str, chunks: dict[str, SaveItem], ctx: Any) -> None:
    """Collective: write `chunks` as ``dcp.save`` would, through host copies and the backend's collectives."""
    hosted = with_copies(chunks, ctx.backend.to_host)
    failure = None
    try:
        write_rank(directory, hosted, ctx.rank)
    except (OSError, CheckpointError) as exc:
        failure = exc
    # Also the barrier: rank 0 reads every rank's plan only after all have written theirs.
    if collective.any_rank(ctx, failure is not None):
        raise CheckpointError(f"writing the checkpoint shards into {directory} failed on rank "
                              f"{ctx.rank if failure else 'another rank'}: {failure or 'see its error'}")
    collective.on_rank0(ctx, f"writing the DCP metadata of {directory}",
                        lambda: write_metadata(directory, ctx.world_size))


def load_chunks_to_device(directory: str, chunks: dict[str, FlatChunk]) -> None:
    """Fill each FlatChunk in place (on its device) from this rank's overlap with the stored chunks."""
    hosted = {k: FlatChunk(torch.empty(c.local.numel(), dtype=c.local.dtype), c.offset, c.full_shape,
                        c.block)
              for k, c in chunks.items()}
    load_chunks(directory, hosted, no_dist=True)
    with torch.no_grad():
        for key, chunk in chunks.items():
            chunk.local.copy_(hosted[key].local.to(chunk.local.device))
