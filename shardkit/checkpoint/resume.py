"""`latest(directory)`: the checkpoint a restarted job resumes from.

A job that saves `ckpt/step_000100`, `ckpt/step_000200`, ... and is killed may leave the newest
one unfinished (``step_000300.tmp-*``, or a directory without its manifest). Only complete
checkpoints count: the manifest is written last, so its presence is the mark. The order is the
recorded step (save(step=...) or extra["step"]), then the manifest's creation time and the name,
so a job that records no step still gets its newest save.

A checkpoint can also be complete and damaged afterwards (a disk error, a byte flipped, a file
truncated by a copy). `latest(directory, verify=True)` returns the newest one whose files match
their manifest (sizes, then sha256), logging each newer one it skipped and why, so a restart
loop resumes from the last good save instead of failing on the same file at every attempt.
"""

from __future__ import annotations

import os

from ..logs import logger
from ..job.runtime import current_context
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


def latest(directory: str | os.PathLike, verify: bool = False) -> str | None:
    """The newest complete checkpoint directly under `directory` (highest step, then newest), or None.

    verify=True: the newest one whose files match their manifest; each newer one skipped is
    logged (shardkit logger, WARNING) with its bad file. Cost: it reads every byte of the
    checkpoint it returns and of each one it skips up to its first bad file (a size mismatch costs
    nothing). In a running job of several ranks it is collective, like load(verify=True): every
    rank calls it and hashes 1/N of the files; elsewhere the calling process hashes them all.
    """
    found = complete(directory)
    if not verify:
        return found[-1] if found else None
    skipped = []
    for path in reversed(found):
        problem = _first_problem(mf.resolve(path))
        if problem is None:
            break
        skipped.append(path)
        logger.warning("checkpoint.latest: skipping %s, which does not match its manifest: %s",
                       path, problem)
    else:
        path = None
    if skipped:
        logger.warning("checkpoint.latest: resuming from %s instead of the %d newer damaged one(s)",
                       path or "the start (no good checkpoint)", len(skipped))
    return path


def _first_problem(directory: str) -> str | None:
    """Why the checkpoint at `directory` is damaged (the first bad file), or None when it verifies."""
    from .errors import CorruptCheckpointError
    from .sharded import verify_files

    manifest = mf.read_manifest(directory)
    ctx = current_context()
    if ctx is not None and ctx.world_size > 1:
        try:
            verify_files(ctx, directory, manifest)
        except CorruptCheckpointError as exc:
            return str(exc).splitlines()[1].strip()
        return None
    for rel in sorted(manifest["files"]):
        problem = mf.check_file(directory, rel, manifest["files"][rel])
        if problem:
            return problem
    return None
