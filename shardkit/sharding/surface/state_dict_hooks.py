"""torch's state_dict()/load_state_dict() on a sharded model: never half a model, silently.

After shard() each parameter is a DTensor whose local tensor is this rank's rows (or, without a
mesh, the rows themselves: sharding/step/whole_view.py), so `model.state_dict()` holds this rank's part
of the model: each value's `.full_tensor()` (collective) is the whole tensor, as with FSDP2.
Three habits would go wrong without a word (issue 40):

- `torch.save(model.state_dict())` on rank 0, the DDP habit, writes one rank's part of the
  model. Such a call warns (ShardedStateDictWarning; Python shows it once per calling line)
  naming the whole-model calls, unless torch's own checkpointing (get_model_state_dict,
  dcp.save) makes it, which treats the DTensors as the whole model, and the dict is tagged in its `_metadata` (which torch.save keeps) with
  the rank and group size whose rows it holds.
- Loading that dict into a sharded model would copy rank 0's rows into every rank. A tagged
  dict loads only into the rank and group size that wrote it; any other is refused, naming both.
- `model.load_state_dict(full_state_dict)` (a checkpoint of the unsharded model) would fail on
  shapes or types. A plain tensor of the parameter's full shape is cut to this rank's rows (no
  communication), as shardkit.checkpoint.load_full_state_dict does.

Both hooks are module-level functions registered on the sharded model itself, so they live and
die with it, and they work whether the model is loaded directly or as a child of another module.
"""

from __future__ import annotations

import os
import sys
import types
import warnings

import torch
from torch import nn

from ...errors import ShardedStateDictWarning, ShardkitError
from .module_api import get_state
from ..step.whole_view import is_dtensor, local_of

TAG = "shardkit_shard"  # key in the sharded module's state_dict _metadata entry


def install(model: nn.Module) -> None:
    """Register the tagging state_dict hook and the row-cutting load pre-hook on a sharded model."""
    model._register_state_dict_hook(_tag_rows)
    model._register_load_state_dict_pre_hook(_cut_to_rows, with_module=True)


def _called_by_torchs_checkpointing() -> bool:
    """True inside torch.distributed.checkpoint (get_model_state_dict, dcp.save): it handles a
    dict of DTensors as the whole model, so there is nothing to warn about."""
    frame: types.FrameType | None = sys._getframe(2)
    for _ in range(40):  # torch's state-dict helpers sit a few frames above the hook
        if frame is None:
            return False
        if _TORCH_CHECKPOINTING in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


_TORCH_CHECKPOINTING = os.path.join("torch", "distributed", "checkpoint", "")


def _tag_rows(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    state = get_state(module)
    local_metadata[TAG] = {"rank": state.shard_group.rank, "group_size": state.shard_group.size}
    if state.shard_group.size < 2 or _called_by_torchs_checkpointing():
        return
    by_fqn = state.params_by_fqn()
    # keep_vars=True hands back the live Parameters: shardkit's own lookups by name, not a copy
    # on its way to a file.
    detached = [k for k in by_fqn if state_dict.get(prefix + k) is not None
                and not isinstance(state_dict[prefix + k], nn.Parameter)]
    if detached:
        # Each call warns (Python's default filter shows it once per line that calls it): the
        # habit it catches, torch.save on rank 0, is a line of its own wherever it is.
        state.warned_state_dict = True
        warnings.warn(
            f"state_dict() of a model sharded by shardkit holds rank {state.shard_group.rank}'s "
            f"rows of each parameter (1 of {state.shard_group.size} shards; a DTensor's "
            ".full_tensor() is collective), not the whole model: torch.save of it on one "
            "rank is not a full checkpoint (dcp.save of it on every rank is). HINT: "
            "shardkit.checkpoint.full_state_dict(model) on every rank gives rank 0 the whole "
            "model's dict; shardkit.checkpoint.export(dir, model) writes safetensors files that "
            "from_pretrained() reads; shardkit.checkpoint.save(path, model, optimizer) writes a "
            "checkpoint that loads at any world size",
            ShardedStateDictWarning, stacklevel=3)


def _cut_to_rows(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict,
                 strict: bool, missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
    if local_metadata.get("assign_to_params_buffers"):
        raise ShardkitError("load_state_dict(..., assign=True) on a sharded model would replace "
                            "the shards the engine and the optimizer hold. HINT: load without "
                            "assign=True (values are copied into the shards)")
    state = get_state(module)
    mine = (state.shard_group.rank, state.shard_group.size)
    tag = local_metadata.get(TAG)
    for fqn, sp in state.params_by_fqn().items():
        value = state_dict.get(prefix + fqn)
        if not isinstance(value, torch.Tensor):
            continue  # absent: torch reports missing keys as usual
        rows = local_of(value)  # a DTensor's local rows; a plain tensor itself
        if tag is not None:
            if ((tag.get("rank"), tag.get("group_size")) != mine
                    or tuple(rows.shape) not in (tuple(sp.shard_shape), tuple(sp.user_shape))):
                raise ShardkitError(
                    f"this state dict holds shard {tag.get('rank')} of {tag.get('group_size')} "
                    f"(one rank's rows, from state_dict() of a sharded model; {fqn!r} is "
                    f"{tuple(rows.shape)}), but this rank holds shard {mine[0]} of {mine[1]}: "
                    "loading it would put another rank's rows here. HINT: save the whole model "
                    "with shardkit.checkpoint.full_state_dict(model) (every rank calls it) and "
                    "load that dict, or use shardkit.checkpoint.save/load, which reshard across "
                    "world sizes")
        elif value.shape == sp.full_shape and not is_dtensor(value):
            state_dict[prefix + fqn] = sp.as_user(sp.rows_of(value, sp.local.device))
            continue
        elif not (is_dtensor(value) and value.shape == sp.full_shape
                  and rows.shape == sp.user_shape):  # untagged DTensors: taken to be this rank's
            raise ShardkitError(
                f"state_dict[{prefix + fqn!r}] has shape {tuple(value.shape)}, but the parameter "
                f"is {tuple(sp.full_shape)} (this rank holds rows of shape "
                f"{tuple(sp.shard_shape)}). HINT: load a state dict of the unsharded model "
                "(shardkit.checkpoint.full_state_dict gives one), or the dict this same rank "
                "wrote with state_dict()")
        state_dict[prefix + fqn] = sp.as_user(sp.as_rows(value).to(sp.local.device))  # own rows

