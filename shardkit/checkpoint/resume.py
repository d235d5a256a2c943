"""`latest(directory)`: the checkpoint a restarted job resumes from.

A job that saves `ckpt/step_000100`, `ckpt/step_000200`, ... and is killed may leave the newest
one unfinished (``step_000300.tmp-*``, or a directory without its manifest). Only complete
checkpoints count: the manifest is written last, so its presence is the mark. The order is the
recorded step (save(step=...) or extra["step"]), then the manifest's creation time and the name,
so a job that records no step still gets its newest save.
"""

from __future__ import annotations

import os

from . import manifest as mf
from .errors import CheckpointError


def _candidates(directory: str) -> list[str]:
    names = set(os.listdir(directory))
    out = []
    for name in names:
        if mf.TMP_MARK in name or not os.path.isdir(os.path.join(directory, name)):
            continue
        if name.endswith(mf.OLD_SUFFIX):
            # A crash between replace_dir's two renames: the `.old` one stands in for its path.
            name = name[:-len(mf.OLD_SUFFIX)]
            if name in names:
                continue
        out.append(os.path.join(directory, name))
    return out


def complete(directory: str | os.PathLike) -> list[str]:
    """Every complete checkpoint directly under `directory`, oldest first (by step, then creation time)."""
    directory = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(directory):
        return []
    ranked = []
    for path in _candidates(directory):
        try:
            manifest = mf.read_manifest(mf.resolve(path))
        except CheckpointError:
            continue  # unfinished or not a checkpoint: never the one to resume from
        step = manifest.get("step")
        ranked.append((isinstance(step, int), step if isinstance(step, int) else 0,
                       manifest.get("created", ""), os.path.basename(path), path))
    return [entry[-1] for entry in sorted(ranked)]


def latest(directory: str | os.PathLike) -> str | None:
    """The newest complete checkpoint directly under `directory` (highest step, then newest), or None."""
    found = complete(directory)
    return found[-1] if found else None
