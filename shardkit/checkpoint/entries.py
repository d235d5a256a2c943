"""What a sharded model and its optimizer contribute to a checkpoint, named and ordered like state_dict()."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..sharding.surface.views import ShardView, shard_views
from .errors import CheckpointError

# Entry names in the DCP folder. Format 2 names them as torchtitan lays out an FSDP2 model's state
# (`{**get_model_state_dict(m), "optimizer": get_optimizer_state_dict(m, o, flattened)}`), so
# torch's dcp.load fills those state dicts from a shardkit checkpoint; format 1 had its own.
OPTIMIZER_PREFIX = "optimizer."
_MODEL_PREFIX_FORMAT_1 = "model/"


@dataclass
class Entry:
    """One model state_dict entry: a sharded parameter (`view` set) or a full, replicated buffer (`buffer` set)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    view: ShardView | None = None
    buffer: torch.Tensor | None = None

    @property
    def numel(self) -> int:
        """Number of elements of the full tensor."""
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        """Bytes of the full tensor."""
        return self.numel * self.dtype.itemsize


def persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Buffers that state_dict() would contain, by original name."""
    out = {}
    for prefix, sub in module.named_modules():
        skip: set[str] = getattr(sub, "_non_persistent_buffers_set", set())
        for name, buf in sub._buffers.items():
            if buf is not None and name not in skip:
                out[f"{prefix}.{name}" if prefix else name] = buf
    return out


def model_entries(module: torch.nn.Module) -> list[Entry]:
    """Every parameter (sharded) and persistent buffer (replicated) of a sharded model, in state_dict order."""
    views = {v.fqn: v for v in shard_views(module)}
    buffers = persistent_buffers(module)
    order: list[str] = []
    for prefix, sub in module.named_modules():
        for name in list(sub._parameters) + list(sub._buffers):
            fqn = f"{prefix}.{name}" if prefix else name
            if (fqn in views or fqn in buffers) and fqn not in order:
                order.append(fqn)
    order += [fqn for fqn in views if fqn not in order]
    out = []
    for fqn in order:
        if fqn in views:
            v = views[fqn]
            out.append(Entry(fqn, tuple(v.full_shape), v.dtype, view=v))
        else:
            b = buffers[fqn]
            out.append(Entry(fqn, tuple(b.shape), b.dtype, buffer=b))
    return out


def param_fqns(module: torch.nn.Module) -> dict[int, ShardView]:
    """Map id(sharded parameter) -> its ShardView, to name the optimizer's parameters."""
    out: dict[int, ShardView] = {}
    for v in shard_views(module):
        out.setdefault(id(v.param), v)  # tied parameters: the first name in state_dict order
    return out


def optimizer_views(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[ShardView]]:
    """The ShardView of every parameter of every param group, or an error naming strangers."""
    by_id = param_fqns(module)
    groups = []
    for gi, group in enumerate(optimizer.param_groups):
        views = []
        for pi, p in enumerate(group["params"]):
            if id(p) not in by_id:
                raise CheckpointError(
                    f"optimizer param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)}) is not "
                    "a sharded parameter of this model. HINT: build the optimizer from "
                    "model.parameters() after shardkit.shard(model).")
            views.append(by_id[id(p)])
        groups.append(views)
    return groups


def is_shard_state(value: Any, view: ShardView) -> bool:
    """True for optimizer state laid out like the parameter's shard (e.g. Adam's exp_avg).

    0-d state never is: it cannot be told apart from a counter such as Adam's `step`, and a 0-d
    parameter's only element lives on shard rank 0, whose state is saved as small state.
    """
    return (isinstance(value, torch.Tensor) and value.dim() >= 1
            and value.shape == view.param.shape)


def model_key(name: str, format_version: int) -> str:
    """Checkpoint entry name of a model's state_dict entry in a checkpoint of that format."""
    return name if format_version >= 2 else _MODEL_PREFIX_FORMAT_1 + name


def optim_key(fqn: str, state_key: str) -> str:
    """Checkpoint entry name of one per-parameter optimizer state value (torch's flattened name;
    format 1's names are read from its manifest)."""
    return f"{OPTIMIZER_PREFIX}state.{fqn}.{state_key}"


def optim_group_key(fqn: str, setting: str) -> str:
    """Checkpoint entry name of a param group's setting for one parameter (torch's flattened name)."""
    return f"{OPTIMIZER_PREFIX}param_groups.{fqn}.{setting}"


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """torch.float32 for 'float32'."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint manifest")
    return dtype
