"""Offline tools on a saved checkpoint, no process group needed: consolidate to safetensors, inspect, read `extra`."""

from __future__ import annotations

import os
from typing import Any

from . import manifest as mf
from .dcp_io import FlatTensorReader
from .entries import dtype_from_name, model_key
from .errors import CorruptCheckpointError
from .safetensors_io import DEFAULT_MAX_SHARD_SIZE, SafetensorsLayout, is_weights_dir


def verify_offline(directory: str, manifest: dict) -> None:
    """Check every file's size and sha256 against the manifest; raise naming the bad ones."""
    problems = [msg for rel, exp in sorted(manifest["files"].items())
                if (msg := mf.check_file(directory, rel, exp))]
    if problems:
        raise CorruptCheckpointError("checkpoint files do not match their manifest:\n  "
                                     + "\n  ".join(problems))


def consolidate(checkpoint: str | os.PathLike, out: str | os.PathLike,
                max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, verify: bool = True) -> str:
    """Turn a sharded checkpoint into the same safetensors files `export` writes, one tensor in memory at a time."""
    directory = mf.resolve(os.fspath(checkpoint))
    manifest = mf.read_manifest(directory)
    if verify:
        verify_offline(directory, manifest)
    model = manifest["model"]
    layout = SafetensorsLayout([(name, tuple(md["shape"]), dtype_from_name(md["dtype"]))
                                for name, md in model.items()], max_shard_size)
    out = os.path.abspath(os.fspath(out))
    mf.check_replaceable(out, is_weights_dir, "safetensors weights directory")
    tmp = f"{out}{mf.TMP_MARK}{os.getpid()}"
    layout.create(tmp)
    reader = FlatTensorReader(directory)
    for name, md in model.items():
        stored = reader.read(model_key(name, mf.format_version(manifest)))
        layout.write(tmp, name, stored.view(tuple(md["shape"])))
    layout.finish(tmp)
    mf.replace_dir(tmp, out)
    return out


def inspect_checkpoint(checkpoint: str | os.PathLike) -> dict[str, Any]:
    """What a checkpoint holds: world size, strategy, versions, step, and every entry's shape and dtype."""
    directory = mf.resolve(os.fspath(checkpoint))
    manifest = mf.read_manifest(directory)
    keys = ("world_size", "strategy", "shard_group_size", "replica_group_size", "backend", "step",
            "shardkit_version", "torch_version", "created")
    return {"path": directory, **{k: manifest.get(k) for k in keys},
            "model": manifest["model"], "optimizer": manifest["optimizer"],
            "bytes": sum(f["size"] for f in manifest["files"].values())}


def read_extra(checkpoint: str | os.PathLike) -> Any:
    """The `extra` a checkpoint was saved with (what `load` returns), read without a model or a job."""
    from .sharded import read_state  # here: `shardkit inspect` and consolidate need no engine

    directory = mf.resolve(os.fspath(checkpoint))
    mf.read_manifest(directory)  # refuses an unfinished or foreign directory, naming it
    return read_state(directory)["extra"]


def format_inspection(info: dict[str, Any]) -> str:
    """Human-readable text for `shardkit inspect`."""
    lines = [f"checkpoint   {info['path']}",
             f"world size   {info['world_size']}   strategy {info['strategy']}   "
             f"(shard group {info['shard_group_size']}, replica group {info['replica_group_size']})",
             f"step         {info['step']}",
             f"saved by     shardkit {info['shardkit_version']}, torch {info['torch_version']}, "
             f"backend {info['backend']}, {info['created']}",
             f"size         {info['bytes']:,} bytes on disk", "", "model:"]
    width = max((len(n) for n in info["model"]), default=0)
    for name, md in info["model"].items():
        lines.append(f"  {name:<{width}}  {md['kind']:<6}  {str(tuple(md['shape'])):<18}  {md['dtype']}")
    if info["optimizer"]:
        states = sorted({md["state"] for md in info["optimizer"].values()})
        lines += ["", f"optimizer:   {len(info['optimizer'])} sharded state tensors "
                      f"({', '.join(states)})"]
    return "\n".join(lines)
