"""The manifest written last into every checkpoint, file checksums, and crash-safe directory replacement.

A checkpoint directory is complete exactly when its ``shardkit_manifest.json`` exists: it is written
(and fsynced) after every other file, and lists each file's size and sha256.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import shutil
from typing import Any, Callable

from .errors import (CheckpointError, CheckpointNotFoundError, CorruptCheckpointError,
                     IncompleteCheckpointError)

MANIFEST_FILE = "shardkit_manifest.json"
STATE_FILE = "shardkit_state.pt"  # rank 0's pickle-free blob: `extra` and small optimizer state
FORMAT = "shardkit-checkpoint"
# 2: entries named and shaped as FSDP2's state dicts (torch's dcp.load reads the folder); 1: shards
# flattened to 1-D under shardkit's own names (still read).
FORMAT_VERSION = 2
OLD_SUFFIX = ".old"
TMP_MARK = ".tmp-"
_HASH_BLOCK = 1 << 22


def sha256_file(path: str) -> str:
    """Hex sha256 of a file, read in blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_HASH_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def data_files(directory: str) -> list[str]:
    """Every file of a checkpoint except the manifest, as sorted relative paths."""
    out = []
    for root, _, names in os.walk(directory):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), directory)
            if rel != MANIFEST_FILE:
                out.append(rel)
    return sorted(out)


def fsync_dir(directory: str) -> None:
    """Make renames and new names inside `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_synced(path: str, data: bytes) -> None:
    """Write `data` to `path` and fsync it (a checkpoint file must be on disk before its manifest)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_json_atomic(path: str, obj: Any) -> None:
    """Write JSON to `path` through a temporary name, fsynced, so readers never see half a file."""
    tmp = f"{path}{TMP_MARK}{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_manifest(directory: str, info: dict[str, Any], hashes: dict[str, str]) -> dict:
    """Record sizes and checksums of every file in `directory`, then the manifest itself, last."""
    files = {}
    for rel in data_files(directory):
        if rel not in hashes:
            raise CorruptCheckpointError(f"{os.path.join(directory, rel)}: appeared during save "
                                         "without a checksum")
        files[rel] = {"size": os.path.getsize(os.path.join(directory, rel)), "sha256": hashes[rel]}
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, **info, "files": files}
    write_json_atomic(os.path.join(directory, MANIFEST_FILE), manifest)
    return manifest


def read_manifest(directory: str) -> dict:
    """Return the manifest of a complete checkpoint, or raise saying why it is not one."""
    path = os.path.join(directory, MANIFEST_FILE)
    if not os.path.isdir(directory):
        raise CheckpointNotFoundError(f"no checkpoint at {directory}{nearby_hint(directory)}")
    if not os.path.exists(path):
        raise IncompleteCheckpointError(describe_without_manifest(directory))
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise CorruptCheckpointError(f"{path}: unreadable manifest ({exc})") from exc
    if manifest.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{path}: not a shardkit checkpoint manifest")
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"{path}: checkpoint format {manifest['format_version']} is newer than this shardkit "
            f"reads ({FORMAT_VERSION}). HINT: upgrade shardkit.")
    return manifest


def format_version(manifest: dict) -> int:
    """The checkpoint format a manifest was written in (1 where it predates the field)."""
    return int(manifest.get("format_version", 1))


def check_file(directory: str, rel: str, expected: dict, with_hash: bool = True) -> str | None:
    """Return a message if a checkpoint file's size or sha256 differs from the manifest, else None."""
    path = os.path.join(directory, rel)
    if not os.path.exists(path):
        return f"{path}: missing"
    size = os.path.getsize(path)
    if size != expected["size"]:
        return f"{path}: size {size} bytes, manifest says {expected['size']} (truncated or overwritten)"
    if with_hash and sha256_file(path) != expected["sha256"]:
        return f"{path}: sha256 differs from the manifest (corrupted)"
    return None


def resolve(path: str) -> str:
    """Return the complete checkpoint directory to read for `path`, recovering an interrupted replace.

    A save replaces an existing checkpoint by renaming it to ``<path>.old`` and the new one into
    place; a crash between the two renames leaves only ``<path>.old``, which is then used.
    """
    path = os.path.abspath(path)
    if os.path.isdir(path):
        read_manifest(path)
        return path
    old = path + OLD_SUFFIX
    if os.path.isdir(old) and os.path.exists(os.path.join(old, MANIFEST_FILE)):
        return old
    parent, base = os.path.split(path)
    partial = [n for n in (os.listdir(parent) if os.path.isdir(parent) else ())
               if n.startswith(base + TMP_MARK)]
    if partial:
        raise IncompleteCheckpointError(
            f"no complete checkpoint at {path}; only unfinished saves: "
            f"{', '.join(os.path.join(parent, n) for n in sorted(partial))}")
    raise CheckpointNotFoundError(f"no checkpoint at {path}{nearby_hint(path)}")


def nearby_checkpoints(path: str, limit: int = 3) -> list[str]:
    """Complete checkpoints beside `path` or in a folder beside its parent (a typo in either name:
    ckpt/ for ckpts/, step_39 for step_000039), the most alike first; at most `limit`."""
    path = os.path.abspath(path)
    parent, base = os.path.split(path)
    grandparent, parent_name = os.path.split(parent)

    def subdirs(folder: str) -> list[str]:
        try:
            with os.scandir(folder) as entries:
                return sorted(e.path for e in entries if e.is_dir())[:1000]  # bounded: a big folder
        except OSError:
            return []
    places = [parent] if os.path.isdir(parent) else []
    places += [d for d in subdirs(grandparent) if d != parent]
    found = [d for place in places for d in subdirs(place)
             if os.path.isfile(os.path.join(d, MANIFEST_FILE))]
    found += [d for d in places if os.path.isfile(os.path.join(d, MANIFEST_FILE))]

    def likeness(candidate: str) -> tuple[float, float]:
        folder, name = os.path.split(candidate)
        return (-difflib.SequenceMatcher(None, name, base).ratio(),
                -difflib.SequenceMatcher(None, os.path.basename(folder), parent_name).ratio())
    return sorted(set(found), key=likeness)[:limit]


def nearby_hint(path: str) -> str:
    """'. HINT: complete checkpoints nearby: ...' for a path with none, or "" when none is near."""
    near = nearby_checkpoints(path)
    if not near:
        return ""
    return (f". HINT: complete checkpoints nearby: {', '.join(near)} (shardkit.checkpoint.latest(folder) "
            "finds a folder's newest)")


def replace_dir(tmp: str, path: str) -> None:
    """Move the finished `tmp` checkpoint to `path`; a complete checkpoint exists at every instant."""
    path = os.path.abspath(path)
    old = path + OLD_SUFFIX
    if os.path.isdir(path):
        if os.path.isdir(old):
            shutil.rmtree(old)  # a leftover from an earlier crash; `path` is complete
        os.rename(path, old)
    os.rename(tmp, path)
    fsync_dir(os.path.dirname(path))
    if os.path.isdir(old):
        shutil.rmtree(old)


def check_replaceable(path: str, looks_like: Callable[[str], bool], what: str) -> None:
    """Refuse to overwrite an existing directory that is not what we would write there."""
    if os.path.exists(path) and not (os.path.isdir(path) and looks_like(path)):
        raise CheckpointError(
            f"{path} exists and is not a {what}; refusing to replace it. HINT: choose another "
            "path or remove it yourself.")


def is_checkpoint_dir(path: str) -> bool:
    """True where a save may replace what is there: a complete shardkit checkpoint or an empty
    directory. A save is written under a temporary name and renamed into place once its manifest
    is written, so a folder without the manifest at `path` is never shardkit's unfinished save:
    it may be a torch DCP checkpoint (FSDP2, torchtitan) that a save would have deleted."""
    return os.path.exists(os.path.join(path, MANIFEST_FILE)) or not os.listdir(path)


def is_torch_dcp(directory: str) -> bool:
    """True for a folder torch DCP wrote and shardkit did not (FSDP2, torchtitan, dcp.save): DCP's
    .metadata without a manifest, without shardkit's state file (a shardkit checkpoint whose
    manifest was lost), and not under a save's temporary name (shardkit's unfinished save)."""
    if not os.path.isdir(directory):
        return False
    names = set(os.listdir(directory))
    if ".metadata" not in names or MANIFEST_FILE in names or STATE_FILE in names:
        return False
    final, marked, token = os.path.basename(os.path.abspath(directory)).rpartition(TMP_MARK)
    return not (marked and final and token)


_HF_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json",
             "pytorch_model.bin", "pytorch_model.bin.index.json")


def describe_without_manifest(directory: str) -> str:
    """Why `directory`, which has no manifest, is not a checkpoint to load, from what it holds,
    and the route that reads it. Only a folder with a save's temporary name is shardkit's own
    unfinished save, and only that one is said to be safe to delete."""
    names = sorted(os.listdir(directory))
    missing = f"{MANIFEST_FILE} is missing"
    parent, base = os.path.split(os.path.abspath(directory))
    final, marked, token = base.rpartition(TMP_MARK)
    if marked and final and token and not token.endswith(".failed"):
        return (f"{directory} is an incomplete checkpoint, a save that never finished: {missing} "
                f"(a save writes it last, then renames the folder to {final}). HINT: load "
                f"{os.path.join(parent, final)} or an earlier checkpoint; this folder is shardkit's "
                "own unfinished save, safe to delete (the next save to that path removes it).")
    if not names:
        return (f"{directory} is empty: {missing} and nothing else is there, so no save finished "
                f"there{nearby_hint(directory) or '. HINT: check the path'}.")
    if STATE_FILE in names:
        return (f"{directory} holds a shardkit checkpoint's files but {missing}: a save renames "
                "its folder into place only after writing the manifest, so the manifest was lost "
                "or removed since. HINT: keep the folder (its data may be whole) and load an "
                "earlier checkpoint.")
    if ".metadata" in names:
        return (f"{directory} is a torch DCP checkpoint (its .metadata: written by FSDP2, "
                f"torchtitan or dcp.save), not a shardkit one ({missing}). HINT: "
                "shardkit.checkpoint.load(DIR, model[, optimizer]) reads it into a sharded model "
                "at any world size (through torch's get/set_model_state_dict), as do torch's own "
                "dcp.load and set_model_state_dict.")
    hf = [n for n in names if n in _HF_FILES or n.endswith(".safetensors")]
    if hf:
        return (f"{directory} holds Hugging Face or safetensors weights ({', '.join(hf[:3])}), "
                f"not a shardkit checkpoint ({missing}). HINT: "
                "shardkit.checkpoint.load_full_state_dict(model, DIR) loads safetensors weights "
                "into a sharded model (each rank keeps its rows); from_pretrained() reads them "
                "into an unsharded one.")
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    near = nearby_checkpoints(directory)
    return (f"{directory} is not a shardkit checkpoint: {missing}; it holds {shown}. HINT: "
            f"pass the folder checkpoint.save wrote (it holds {MANIFEST_FILE})"
            + (f"; complete checkpoints nearby: {', '.join(near)}" if near else "") + ".")


def remove_stale_tmp(path: str, keep: str) -> None:
    """Delete unfinished saves (``<path>.tmp-*``) left by crashed processes, except `keep`."""
    parent, base = os.path.split(os.path.abspath(path))
    for name in os.listdir(parent):
        full = os.path.join(parent, name)
        if not name.startswith(base + TMP_MARK) or full == keep:
            continue
        if os.path.isdir(full):
            shutil.rmtree(full, ignore_errors=True)
        elif name.endswith(".failed"):  # a failed background save's report, already raised
            os.remove(full)
