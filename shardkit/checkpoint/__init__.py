"""Checkpoints for sharded models: DCP sharded save/load at any world size, full state dicts, safetensors.

``save``/``load`` write and read sharded checkpoints (torch.distributed.checkpoint) that reshard on
load (``save(..., background=True)`` writes from a thread once the shards are copied to host
memory; ranks that pass different arguments are refused); ``latest`` and ``complete`` name the
complete checkpoints in a directory, for a restarted job to resume from (``latest(dir,
verify=True)`` skips damaged ones); ``full_state_dict`` and ``export`` gather unit by unit;
``load_full_state_dict`` loads full weights into a sharded model; ``consolidate``, ``inspect``
(``inspect_checkpoint``) and ``read_extra`` work offline.

Layout: sharded (``save`` / ``load``), background (the writer thread of ``background=True``),
dcp_io (DCP I/O, one flat chunk per rank and tensor) and host_io (the same files written and read
without a process group), manifest (the manifest written last, checksums, crash-safe replacement),
entries (what a model and its optimizer contribute, named like state_dict()), collective (the
few collectives checkpointing needs), resume (``latest``), full (full state dicts, ``export``,
``load_full_state_dict``) and safetensors_io (the safetensors files and their index; a rank reads
only its rows), torch_dcp (``load`` of a torch DCP folder that FSDP2, torchtitan or dcp.save
wrote, through torch's state-dict API), offline and cli (``consolidate`` / ``inspect`` without a
job), disk_full (a full disk named as one), errors.
"""

from importlib import import_module
from typing import Any

from .errors import (CheckpointError, CheckpointNotFoundError, CorruptCheckpointError,
                     IncompleteCheckpointError, StateDictMismatchError)

# Imported on first use: torch.distributed.checkpoint is slow to import and the `shardkit` CLI
# registers these subcommands without needing it.
_LAZY = {"save": "sharded", "load": "sharded", "full_state_dict": "full", "export": "full",
         "load_full_state_dict": "full", "consolidate": "offline",
         "inspect_checkpoint": "offline", "format_inspection": "offline", "read_extra": "offline",
         "latest": "resume", "complete": "resume",
         "BackgroundSave": "background"}


def __getattr__(name: str) -> Any:
    """Resolve the public functions lazily from their modules."""
    if name == "inspect":
        name = "inspect_checkpoint"
    if name not in _LAZY:
        raise AttributeError(f"module 'shardkit.checkpoint' has no attribute {name!r}")
    return getattr(import_module(f".{_LAZY[name]}", __name__), name)


__all__ = ["BackgroundSave", "CheckpointError", "CheckpointNotFoundError", "CorruptCheckpointError",
           "IncompleteCheckpointError", "StateDictMismatchError", "complete", "consolidate", "export",
           "format_inspection", "full_state_dict", "inspect", "inspect_checkpoint", "latest", "load",
           "load_full_state_dict", "read_extra", "save"]
