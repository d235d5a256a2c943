"""Full (unsharded) weights: gathered unit by unit into a state dict or safetensors files, and loaded back."""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

import torch

from ..sharding.surface.views import iter_unit_full_params, load_param_rows_
from . import collective, manifest as mf
from .entries import model_entries
from .errors import CheckpointError
from .safetensors_io import (DEFAULT_MAX_SHARD_SIZE, SafetensorsLayout, is_weights_dir,
                             read_full_source)


def visit_full_tensors(model: torch.nn.Module, visit: Callable[[str, torch.Tensor], None]) -> None:
    """Collective: call visit(name, full tensor) for every state_dict entry, holding one unit at a time.

    Tensors are valid only during the call: no reference to a unit survives into the next gather.
    """
    entries = model_entries(model)
    seen = set()
    for e in entries:
        if e.buffer is not None:
            seen.add(e.name)
            visit(e.name, e.buffer.detach())
    units = iter(iter_unit_full_params(model))
    while (item := next(units, None)) is not None:
        unit = item[1]
        del item
        for fqn in list(unit):
            seen.add(fqn)
            visit(fqn, unit[fqn])
        del unit
    missing = [e.name for e in entries if e.name not in seen]
    if missing:
        raise CheckpointError(f"the engine gathered no full tensor for {missing}")


def full_state_dict(model: torch.nn.Module, rank0_only: bool = True,
                    cpu_offload: bool = True) -> dict[str, torch.Tensor]:
    """Collective: the original model's state dict (original names), gathered unit by unit.

    With `rank0_only`, other ranks return {}; with `cpu_offload`, tensors land on the CPU as each
    unit is gathered, so the device holds one unit beyond the sharded model.
    """
    ctx = collective.context()
    keep = ctx.rank == 0 or not rank0_only
    out: dict[str, torch.Tensor] = {}
    if keep:
        visit_full_tensors(model, lambda name, tensor: out.__setitem__(
            name, tensor.detach().to("cpu" if cpu_offload else tensor.device, copy=True)))
    else:
        visit_full_tensors(model, lambda name, tensor: None)
    if not keep:
        return {}
    order = [e.name for e in model_entries(model)]
    return {name: out[name] for name in order}


def export(path: str | os.PathLike, model: torch.nn.Module,
           max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, dtype: torch.dtype | None = None) -> str:
    """Collective: write full weights as safetensors (HF layout, index when split), streaming unit by unit.

    `path` becomes a directory with ``model.safetensors`` or ``model-0000i-of-0000n.safetensors``
    files plus ``model.safetensors.index.json``, and a Hugging Face model's ``config.json``, so
    ``from_pretrained(path)`` loads it as it is. `dtype` casts floating tensors (e.g. torch.bfloat16).
    """
    ctx = collective.context()
    path = os.path.abspath(os.fspath(path))
    entries = model_entries(model)
    layout = SafetensorsLayout([(e.name, e.shape, _cast_dtype(e.dtype, dtype)) for e in entries],
                               max_shard_size)
    tmp = f"{path}{mf.TMP_MARK}{collective.shared_token(ctx):012x}"
    collective.on_rank0(ctx, f"creating {tmp}", lambda: (
        mf.check_replaceable(path, is_weights_dir, "safetensors weights directory"),
        layout.create(tmp)))
    if ctx.rank == 0:
        visit_full_tensors(model, lambda name, tensor: layout.write(
            tmp, name, tensor.to(_cast_dtype(tensor.dtype, dtype))))
    else:
        visit_full_tensors(model, lambda name, tensor: None)
    collective.on_rank0(ctx, f"export to {path}", lambda: (layout.finish(tmp),
                                                           _write_configs(model, tmp),
                                                           mf.replace_dir(tmp, path)))
    return path


def _write_configs(model: torch.nn.Module, directory: str) -> None:
    """A Hugging Face model's config.json (and generation_config.json), which from_pretrained()
    needs beside the weights; any model with a `config` that can save itself the same way."""
    for attr in ("config", "generation_config"):
        config = getattr(model, attr, None)
        if config is not None and callable(getattr(config, "save_pretrained", None)):
            config.save_pretrained(directory)


def _cast_dtype(current: torch.dtype, wanted: torch.dtype | None) -> torch.dtype:
    return wanted if wanted is not None and current.is_floating_point else current


def load_full_state_dict(model: torch.nn.Module, source: Any, strict: bool = True) -> None:
    """Load a full state dict (dict, safetensors file/dir, or weights-only torch file); each rank keeps its slices.

    No communication: every rank reads from `source` only its own rows of each parameter (a
    slice of a safetensors file, a meta-initialised model included), and buffers whole.
    """
    from .sharded import compare_entries

    shapes, read = read_full_source(source)
    entries = model_entries(model)
    expected = {e.name: e.shape for e in entries}
    compare_entries(f"full state dict {_describe(source)}", expected, shapes, strict)
    with torch.no_grad():
        for e in entries:
            if e.name not in shapes:
                continue
            if e.view is not None:
                load_param_rows_(model, e.name, functools.partial(read, e.name))
            else:
                assert e.buffer is not None  # an Entry is a parameter or a buffer
                e.buffer.copy_(read(e.name, None))


def _describe(source: Any) -> str:
    return "(dict)" if isinstance(source, dict) else os.fspath(source)
