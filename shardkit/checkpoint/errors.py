"""Errors raised by shardkit.checkpoint: each names the file or entries at fault and what to do."""

from __future__ import annotations

from ..errors import ShardkitError


class CheckpointError(ShardkitError):
    """Base class for checkpoint problems."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint (complete or not) exists at the given path."""


class IncompleteCheckpointError(CheckpointError):
    """A checkpoint directory without its manifest: a save that never finished."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file whose size or checksum differs from the manifest."""


class StateDictMismatchError(CheckpointError):
    """Names or shapes in a checkpoint that do not match the model or optimizer."""

    def __init__(self, what: str, missing=(), unexpected=(), mismatched=()) -> None:
        self.missing = sorted(missing)
        self.unexpected = sorted(unexpected)
        self.mismatched = sorted(mismatched)
        lines = [f"{what} does not match the model:"]
        if self.missing:
            lines.append(f"  missing in the source ({len(self.missing)}): {', '.join(self.missing)}")
        if self.unexpected:
            lines.append(f"  unexpected in the source ({len(self.unexpected)}): "
                         f"{', '.join(self.unexpected)}")
        if self.mismatched:
            lines.append(f"  shape mismatch ({len(self.mismatched)}): {'; '.join(self.mismatched)}")
        lines.append("HINT: load into the same architecture the source was saved from, or pass "
                     "strict=False (shardkit.checkpoint.load or load_full_state_dict) to load "
                     "only the entries both have; shapes must agree either way.")
        super().__init__("\n".join(lines))
