"""`save` and `load`: sharded, resharding-on-load checkpoints of a model, its optimizer and small user state."""

from __future__ import annotations

import datetime
import io
import math
import os
import shutil
from typing import Any

import torch

from .._version import __version__
from ..errors import ShardkitError
from ..sharding.surface.views import ShardView, sharding_info
from ..sharding.step.whole_view import local_of
from . import collective, manifest as mf
from .dcp_io import FlatChunk, SaveItem, SavedObject, load_chunks, save_chunks, with_copies
from .disk_full import name_a_full_disk
from .entries import (OPTIMIZER_PREFIX, Entry, dtype_from_name, dtype_name, is_shard_state,
                      model_entries, model_key, optim_group_key, optim_key, optimizer_views)
from .errors import CheckpointError, CorruptCheckpointError, StateDictMismatchError
from .host_io import load_chunks_to_device, save_chunks_from_host
from .torch_dcp import load_torch_dcp


_EXTRA_HINT = ("HINT: keep `extra` to tensors, numbers, strings, lists, tuples and dicts "
               "(e.g. torch.get_rng_state(), scheduler.state_dict(); turn numpy arrays into "
               "tensors or lists).")


def _check_weights_only(obj: Any, what: str) -> bytes:
    buf = io.BytesIO()
    try:
        torch.save(obj, buf)
    except Exception as exc:  # noqa: BLE001 - a lambda, a lock, an open file: say which
        raise CheckpointError(f"{what} cannot be stored: it does not pickle "
                              f"({type(exc).__name__}: {exc}). {_EXTRA_HINT}") from None
    try:
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - report whatever torch's safe loader refused
        raise CheckpointError(
            f"{what} cannot be stored: loading it back would need to unpickle code ({exc}). "
            f"{_EXTRA_HINT}") from None
    return buf.getvalue()


def _stored_shape(shape, format_version: int = mf.FORMAT_VERSION) -> tuple[int, ...]:
    # Format 1 stored every tensor flattened to 1-D; format 2 keeps its shape, as FSDP2 does.
    shape = tuple(int(s) for s in shape)
    return shape if format_version >= 2 else (math.prod(shape),)


def _chunk(local: torch.Tensor, view: ShardView, reading: bool = False,
           format_version: int = mf.FORMAT_VERSION) -> FlatChunk:
    # A shard is whole rows of its parameter: elements [offset, offset + valid_numel) of the
    # flattened full tensor (a view, so loading fills `local` in place).
    shape = _stored_shape(view.full_shape, format_version)
    if reading and view.replicated:  # every rank holds it; shard rank 0 wrote it
        return FlatChunk(local.detach().view(-1), 0, shape)
    # Beside tensor parallelism the real rows are a block of the whole tensor, not whole rows.
    return FlatChunk(local.detach().view(-1)[:view.valid_numel], view.offset, shape, view.block)


def _whole(tensor: torch.Tensor) -> FlatChunk:
    return FlatChunk(tensor.detach().reshape(-1), 0, tuple(tensor.shape))


def _writes(view: ShardView) -> bool:
    # One replica writes each chunk; ranks whose shard is all padding write nothing.
    first_replica = view.replica_group is None or view.replica_group.rank == 0
    return first_replica and view.tp_writer and view.valid_numel > 0


def _optimizer_state(model, optimizer):
    """(shard-shaped state by (fqn, key), small state by fqn, param groups by fqn)."""
    shards, small, groups = {}, {}, []
    for group, views in zip(optimizer.param_groups, optimizer_views(model, optimizer)):
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": [v.fqn for v in views]})
        for view in views:
            for key, value in optimizer.state.get(view.param, {}).items():
                if is_shard_state(value, view):
                    shards[(view.fqn, key)] = (view, view.as_rows(value.detach()))
                else:
                    small.setdefault(view.fqn, {})[key] = (
                        local_of(value).detach().cpu().clone() if isinstance(value, torch.Tensor)
                        else value)
    return shards, small, groups


def check_path_first(call: str, path: Any, model: Any) -> None:
    """Refuse, before any peer is asked, a call that got the model where the path goes."""
    if isinstance(path, torch.nn.Module):
        raise ShardkitError(
            f"shardkit.checkpoint.{call}() takes the path first, then the model: got "
            f"{type(path).__name__} as the path; HINT: shardkit.checkpoint.{call}(\"ckpt\", "
            f"model, optimizer=opt)")
    if not isinstance(path, (str, os.PathLike)):
        raise ShardkitError(f"shardkit.checkpoint.{call}() needs a path (str or os.PathLike), "
                            f"got {type(path).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise ShardkitError(f"shardkit.checkpoint.{call}() needs the model as its second "
                            f"argument, got {type(model).__name__}")


def save(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
         extra: Any = None, step: int | None = None, background: bool = False) -> Any:
    """Collective: write a sharded checkpoint of model (+ optimizer, + `extra` from rank 0) atomically to `path`.

    Returns the path. background=True returns once this rank's shards are copied to host memory
    and writes them in a thread: a BackgroundSave handle whose wait() returns the path when the
    checkpoint is complete (the next save, load, and the end of the process wait for it too).
    """
    from . import background as bg

    check_path_first("save", path, model)
    bg.wait_pending()  # one save at a time per process, in the order they were asked for
    timeout_s = bg.write_timeout_s() if background else bg.DEFAULT_WRITE_TIMEOUT_S
    ctx = collective.context()
    path = os.path.abspath(os.fspath(path))
    collective.agree(ctx, "shardkit.checkpoint.save", {
        "path": path, "optimizer": optimizer_class_name(optimizer) if optimizer else None,
        "step": step, "background": background})
    entries = model_entries(model)
    shards, small, groups = _optimizer_state(model, optimizer) if optimizer else ({}, {}, None)
    state_blob = collective.on_rank0(ctx, "serialising `extra`", lambda: _check_weights_only(
        {"extra": extra, "optim_groups": groups, "optim_small": small}, "extra"))

    if optimizer is not None:
        _refuse_names_of_the_optimizer(entries)
    chunks: dict[str, SaveItem] = {}
    for e in entries:
        if e.view is not None:
            # An empty parameter still needs one (empty) chunk for DCP to record it.
            if _writes(e.view) or (e.numel == 0 and ctx.rank == 0):
                chunks[model_key(e.name, mf.FORMAT_VERSION)] = _chunk(e.view.local, e.view)
        elif ctx.rank == 0:
            assert e.buffer is not None  # an Entry is a parameter or a buffer
            chunks[model_key(e.name, mf.FORMAT_VERSION)] = _whole(e.buffer)
    for (fqn, key), (view, value) in shards.items():
        if _writes(view):
            chunks[optim_key(fqn, key)] = _chunk(value, view)
    if ctx.rank == 0 and groups is not None:
        chunks.update(_for_torch_readers(small, groups))

    save_id = f"{collective.shared_token(ctx):012x}"
    tmp = f"{path}{mf.TMP_MARK}{save_id}"
    info = {**_info(model, entries, shards, ctx, extra, step, optimizer), "save_id": save_id}
    collective.on_rank0(ctx, f"creating {tmp}", lambda: _make_tmp(path, tmp))
    if background:
        hosted = with_copies(chunks, ctx.backend.snapshot_to_host)
        return bg.start(bg.SaveJob(path, tmp, ctx.rank, ctx.world_size, save_id, hosted,
                                   mf.STATE_FILE, state_blob or b"", info, timeout_s))
    _write_shards(ctx, path, tmp, chunks)
    collective.on_rank0(ctx, f"writing {mf.STATE_FILE}", lambda: mf.write_file_synced(
        os.path.join(tmp, mf.STATE_FILE), state_blob))

    files = mf.data_files(tmp)
    mine = {i: mf.sha256_file(os.path.join(tmp, rel))
            for i, rel in enumerate(files) if i % ctx.world_size == ctx.rank}
    digests = dict(zip(files, collective.merge_digests(ctx, mine, len(files))))
    collective.on_rank0(ctx, f"saving {path}", lambda: (
        mf.write_manifest(tmp, info, digests), mf.replace_dir(tmp, path)))
    return path


def _refuse_names_of_the_optimizer(entries: list[Entry]) -> None:
    # The model's names sit at the top level beside the optimizer's (torchtitan's layout): a
    # model entry under `optimizer.state.` or `optimizer.param_groups.` could take one's place.
    taken = [e.name for e in entries
             if e.name.startswith((OPTIMIZER_PREFIX + "state.", OPTIMIZER_PREFIX + "param_groups."))]
    if taken:
        raise CheckpointError(
            f"the model has entries named like the optimizer's in a checkpoint ({', '.join(taken[:3])}"
            f"): a checkpoint keeps the model's names at the top level and the optimizer's under "
            f"'{OPTIMIZER_PREFIX}state.' and '{OPTIMIZER_PREFIX}param_groups.', as torchtitan "
            "does. HINT: rename that submodule, or save the model alone "
            "(shardkit.checkpoint.save(path, model)).")


def _for_torch_readers(small: dict, groups: list[dict]) -> dict[str, SaveItem]:
    """Rank 0's entries that only torch's readers need: what FSDP2's flattened optimizer state
    dict holds besides the sharded state (step counters, each parameter's group settings).
    shardkit's own load reads them from its state file instead."""
    out: dict[str, SaveItem] = {}
    for fqn, values in small.items():
        for key, value in values.items():
            out[optim_key(fqn, key)] = (_whole(value) if isinstance(value, torch.Tensor)
                                        else SavedObject(value))
    for group in groups:
        for fqn in group["params"]:
            for setting, value in group.items():
                if setting != "params":
                    out[optim_group_key(fqn, setting)] = SavedObject(value)
    return out


def _write_shards(ctx, path: str, tmp: str, chunks: dict[str, SaveItem]) -> None:
    """Every rank writes its shard file; a failure on any rank (disk full) raises on all, saying where."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        if ctx.backend.capabilities.torch_process_group:
            save_chunks(tmp, chunks, ctx.world.handle)
        else:
            save_chunks_from_host(tmp, chunks, ctx)
    except (CheckpointException, OSError) as exc:
        failures = getattr(exc, "failures", None) or {ctx.rank: exc}
        causes = "; ".join(f"rank {r}: {name_a_full_disk(tmp, _root_cause(e))}"
                           for r, e in sorted(failures.items()))
        if ctx.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # give the space back; it never was a checkpoint
        raise CheckpointError(
            f"saving {path} failed while writing shard files into {tmp} ({causes}). Any previous "
            f"checkpoint at {path} is untouched: a save only replaces it once complete. HINT: "
            "free space on that file system or save somewhere writable") from exc


def _root_cause(failure: Any) -> str:
    # DCP reports (exception, traceback) pairs per rank.
    exc = failure[0] if isinstance(failure, tuple) else failure
    return f"{type(exc).__name__}: {exc}"


def _make_tmp(path: str, tmp: str) -> None:
    mf.check_replaceable(path, mf.is_checkpoint_dir, "shardkit checkpoint")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    mf.remove_stale_tmp(path, keep=tmp)
    os.makedirs(tmp)


def optimizer_class_name(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer's class as module.QualName: what a checkpoint records and load compares."""
    # A wrapper that only decides when to step (the fault-tolerant optimizer) holds the wrapped
    # optimizer's state: its checkpoints are that optimizer's, loadable with or without it.
    inner = getattr(optimizer, "wrapped_optimizer", None)
    cls = type(inner if isinstance(inner, torch.optim.Optimizer) else optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def _info(model, entries: list[Entry], shards: dict, ctx, extra: Any, step: int | None,
          optimizer: torch.optim.Optimizer | None) -> dict:
    if step is None and isinstance(extra, dict) and isinstance(extra.get("step"), int):
        step = extra["step"]
    model_md = {e.name: {"kind": "param" if e.view is not None else "buffer",
                         "shape": list(e.shape), "dtype": dtype_name(e.dtype)} for e in entries}
    optim_md = {optim_key(fqn, key): {"param": fqn, "state": key,
                                      "shape": list(view.full_shape), "dtype": dtype_name(value.dtype)}
                for (fqn, key), (view, value) in shards.items()}
    return {"complete": True, **sharding_info(model), "world_size": ctx.world_size,
            "backend": ctx.backend.name, "shardkit_version": __version__,
            "torch_version": torch.__version__, "step": step,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "model": model_md, "optimizer": optim_md,
            "optimizer_class": optimizer_class_name(optimizer) if optimizer is not None else None}


def verify_files(ctx, directory: str, manifest: dict) -> None:
    """Collective: sizes checked by every rank, sha256 split across ranks; raise naming bad files."""
    files = sorted(manifest["files"])
    problems = {}
    for i, rel in enumerate(files):
        msg = mf.check_file(directory, rel, manifest["files"][rel],
                            with_hash=(i % ctx.world_size == ctx.rank))
        if msg:
            problems[i] = msg
    bad = collective.flags_any(ctx, [i in problems for i in range(len(files))])
    names = [problems.get(i, f"{os.path.join(directory, rel)}: sha256 differs from the manifest "
                             "(corrupted; checked on another rank)")
             for i, rel in enumerate(files) if bad[i]]
    if names:
        raise CorruptCheckpointError(
            "checkpoint files do not match their manifest:\n  " + "\n  ".join(names) +
            "\nHINT: the files were truncated or corrupted after the save; load another checkpoint.")


def compare_entries(what: str, expected: dict[str, tuple], found: dict[str, tuple],
                    strict: bool = True) -> None:
    """Raise StateDictMismatchError listing missing, unexpected and differently shaped names
    (strict=False: only names both have are compared, by shape)."""
    if not strict:
        expected = {k: v for k, v in expected.items() if k in found}
        found = {k: v for k, v in found.items() if k in expected}
    missing = set(expected) - set(found)
    unexpected = set(found) - set(expected)
    mismatched = [f"{k}: source {list(found[k])} vs model {list(expected[k])}"
                  for k in expected.keys() & found.keys() if tuple(expected[k]) != tuple(found[k])]
    if missing or unexpected or mismatched:
        raise StateDictMismatchError(what, missing, unexpected, mismatched)


def load(path: str | os.PathLike, model: torch.nn.Module,
         optimizer: torch.optim.Optimizer | None = None, verify: bool = True,
         strict: bool = True) -> Any:
    """Collective: load a checkpoint saved at any world size/strategy into this sharding; return `extra`.

    strict=False loads the model entries the checkpoint and the model share and leaves the rest
    as they are (a new head on a pretrained trunk); shapes must still agree. The optimizer, when
    given, must match the checkpoint's in every case. `path` may also be a torch DCP checkpoint
    written by FSDP2, torchtitan or dcp.save (read through torch's state-dict API, at any world
    size; it carries no `extra`: None is returned).
    """
    from .background import wait_pending

    check_path_first("load", path, model)
    wait_pending()  # a checkpoint this process is still writing is read once complete
    ctx = collective.context()
    collective.agree(ctx, "shardkit.checkpoint.load", {
        "path": os.path.abspath(os.fspath(path)),
        "optimizer": optimizer_class_name(optimizer) if optimizer else None,
        "verify": verify, "strict": strict})
    if mf.is_torch_dcp(os.path.abspath(os.fspath(path))):
        # FSDP2's, torchtitan's or a plain dcp.save's folder: torch's own state-dict API reads it.
        load_torch_dcp(os.path.abspath(os.fspath(path)), model, optimizer, strict)
        return None
    directory = mf.resolve(os.fspath(path))
    manifest = mf.read_manifest(directory)
    if verify:
        verify_files(ctx, directory, manifest)
    version = mf.format_version(manifest)
    entries = model_entries(model)
    expected = {e.name: e.shape for e in entries}
    found = {k: tuple(v["shape"]) for k, v in manifest["model"].items()}
    compare_entries(f"checkpoint {directory}", expected, found, strict)
    if optimizer is not None:
        check_optimizer_class(manifest, optimizer, directory)
    state = read_state(directory)

    chunks: dict[str, FlatChunk] = {}
    pending = []  # buffers that are not contiguous are read into a copy first
    for e in entries:
        if e.name not in found:
            continue  # strict=False: the model keeps what it has
        if e.view is not None:
            chunks[model_key(e.name, version)] = _chunk(e.view.local, e.view, True, version)
        else:
            assert e.buffer is not None  # an Entry is a parameter or a buffer
            if e.buffer.is_contiguous():
                target = e.buffer.data.view(-1)
            else:
                target = e.buffer.reshape(-1).clone()
                pending.append((e.buffer, target))
            chunks[model_key(e.name, version)] = FlatChunk(target, 0, _stored_shape(e.shape, version))
    optim_sd = _prepare_optimizer(model, optimizer, manifest, state, chunks) if optimizer else None
    if ctx.backend.capabilities.torch_process_group:
        load_chunks(directory, chunks, ctx.world.handle)
    else:
        load_chunks_to_device(directory, chunks)
    with torch.no_grad():
        for buf, flat in pending:
            buf.copy_(flat.view(buf.shape))
    if optimizer is not None and optim_sd is not None:
        optimizer.load_state_dict(optim_sd)
    return state["extra"]


def read_state(directory: str) -> dict[str, Any]:
    """Rank 0's state file of a complete checkpoint: `extra` and the optimizer's small state."""
    return torch.load(os.path.join(directory, mf.STATE_FILE), weights_only=True)


def check_optimizer_class(manifest: dict, optimizer: torch.optim.Optimizer, directory: str) -> None:
    """Refuse optimizer state saved by another optimizer class (its state keys would not fit)."""
    saved = manifest.get("optimizer_class")  # absent in checkpoints written before it was recorded
    mine = optimizer_class_name(optimizer)
    if saved is not None and saved != mine:
        raise CheckpointError(
            f"checkpoint {directory} holds the state of a {saved} optimizer, but the optimizer "
            f"given to load() is a {mine}. HINT: build the same optimizer class as at save time, "
            "or load the model alone (shardkit.checkpoint.load(path, model)) and start a fresh "
            "optimizer.")


def _prepare_optimizer(model, optimizer, manifest: dict, state: dict, chunks: dict) -> dict:
    saved_groups = state.get("optim_groups")
    if saved_groups is None:
        raise CheckpointError("the checkpoint holds no optimizer state. HINT: call "
                              "shardkit.checkpoint.load(path, model) without an optimizer.")
    groups = optimizer_views(model, optimizer)
    if len(groups) != len(saved_groups):
        raise CheckpointError(f"the optimizer has {len(groups)} param groups, the checkpoint "
                              f"{len(saved_groups)}. HINT: build the optimizer the same way as "
                              "at save time.")
    version = mf.format_version(manifest)
    shard_keys: dict[str, list[tuple[str, dict]]] = {}
    for key, md in manifest["optimizer"].items():
        shard_keys.setdefault(md["param"], []).append((key, md))
    out_state, out_groups, index = {}, [], 0
    for gi, (views, saved) in enumerate(zip(groups, saved_groups)):
        names = [v.fqn for v in views]
        if sorted(names) != sorted(saved["params"]):
            raise StateDictMismatchError(f"checkpoint optimizer param group {gi}",
                                         set(names) - set(saved["params"]),
                                         set(saved["params"]) - set(names))
        out_groups.append({**{k: v for k, v in saved.items() if k != "params"},
                           "params": list(range(index, index + len(views)))})
        for view in views:
            per_param = {key: _small_state(key, value, view)
                         for key, value in state["optim_small"].get(view.fqn, {}).items()}
            for key, md in shard_keys.get(view.fqn, []):
                # Shaped like the shard, also for checkpoints written when shards were 1-D.
                target = torch.zeros(view.local.shape, dtype=dtype_from_name(md["dtype"]),
                                     device=view.local.device)
                chunks[key] = _chunk(target, view, format_version=version)
                per_param[md["state"]] = view.as_user(target)  # its rows are views of target
            if per_param:
                out_state[index] = per_param
            index += 1
    return {"state": out_state, "param_groups": out_groups}


def _small_state(key: str, value: Any, view: ShardView) -> Any:
    """A small optimizer state value as the optimizer holds it: a 0-d parameter's tensor state laid
    out like the parameter (a DTensor where the parameter is one); counters such as "step"
    stay plain, as torch's own optimizer.load_state_dict treats that key."""
    if (key != "step" and isinstance(value, torch.Tensor) and value.dim() == 0
            and not view.full_shape):
        return view.as_user(value.to(view.local.device))
    return value
