"""Checkpoints for sharded models: DCP sharded save/load at any world size, full state dicts, safetensors.

``save``/``load`` write and read sharded checkpoints (torch.distributed.checkpoint) that reshard on
load; ``full_state_dict`` and ``export`` gather unit by unit; ``load_full_state_dict`` loads full
weights into a sharded model; ``consolidate`` and ``inspect_checkpoint`` work offline.
"""

from .consolidate import consolidate, format_inspection, inspect_checkpoint
from .errors import (CheckpointError, CheckpointNotFoundError, CorruptCheckpointError,
                     IncompleteCheckpointError, StateDictMismatchError)
from .full import export, full_state_dict, load_full_state_dict
from .sharded import load, save

inspect = inspect_checkpoint

__all__ = ["CheckpointError", "CheckpointNotFoundError", "CorruptCheckpointError",
           "IncompleteCheckpointError", "StateDictMismatchError", "consolidate", "export",
           "format_inspection", "full_state_dict", "inspect", "inspect_checkpoint", "load",
           "load_full_state_dict", "save"]
