"""Reading a torch DCP checkpoint that FSDP2, torchtitan or a plain `dcp.save` wrote (issue 54).

Such a folder holds DCP's `.metadata` and no shardkit manifest, and its keys are whatever state
dict was saved, flattened with dots. FSDP2's users save `{"model": get_model_state_dict(m),
"optim": get_optimizer_state_dict(m, o)}` (keys `model.<fqn>`, `optim.state.<fqn>.exp_avg`,
`optim.param_groups`); torchtitan saves the model's entries at the top level and the optimizer
flattened under `optimizer` (`<fqn>`, `optimizer.state.<fqn>.exp_avg`,
`optimizer.param_groups.<fqn>.lr`). Which prefix holds the model and which the optimizer is read
from the metadata (the keys that end with the model's own names), so no layout is assumed, and
torch's own state-dict API does the rest: `get_model_state_dict` / `get_optimizer_state_dict` lay
out this model's DTensors, `dcp.load` fills them (resharding to this world size as it does for
FSDP2), `set_model_state_dict` / `set_optimizer_state_dict` put them in place. That is the route
torch documents for FSDP2 itself, so a checkpoint FSDP2 can resume from, shardkit resumes from.

Where parameters are not DTensors of the whole parameter (XLA's device threads) torch's API
cannot lay them out: that is refused with the route that works there.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from .errors import CheckpointError, StateDictMismatchError

def find_prefix(keys: set[str], names: list[str], strict: bool) -> str | None:
    """The prefix under which `names` are stored among `keys` (every name when strict, else the
    most of them), or None where none is."""
    candidates: set[str] = set()
    for name in names:
        for key in keys:
            if key == name or key.endswith("." + name):
                candidates.add(key[:len(key) - len(name)])
    best, best_count = None, 0
    for prefix in sorted(candidates, key=len):
        count = sum(prefix + name in keys for name in names)
        if count > best_count:
            best, best_count = prefix, count
    if best is None or (strict and best_count < len(names)):
        return None
    return best


def find_optimizer_prefix(keys: set[str], names: list[str]) -> tuple[str, bool] | None:
    """(prefix, flattened) of the optimizer's entries: `<prefix>state.<fqn>.<key>`, with its
    param groups by index or (flattened) per parameter."""
    for name in names:
        pattern = re.compile(r"^(.*?)state\." + re.escape(name) + r"\.[^.]+$")
        for key in sorted(keys):
            match = pattern.match(key)
            if match is None:
                continue
            prefix = match.group(1)
            # Flattened, a group's settings are stored per parameter (param_groups.<fqn>.lr);
            # otherwise DCP stores the list of groups by index (param_groups.0.lr).
            per_param = prefix + "param_groups." + name + "."
            if any(k.startswith(per_param) for k in keys):
                return prefix, True
            if any(k == prefix + "param_groups" or k.startswith(prefix + "param_groups.")
                   for k in keys):
                return prefix, False
    return None


def _nest(state: dict, prefix: str, value: dict) -> dict:
    """Put `value` into `state` at the dotted `prefix` (merged at the top level for "");
    return the dict dcp.load fills in for it."""
    if not prefix:
        state.update(value)
        return state
    parts = prefix.rstrip(".").split(".")
    node = state
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return value


def load_torch_dcp(directory: str, model: torch.nn.Module, optimizer: Any, strict: bool) -> None:
    """Collective: load a torch DCP checkpoint's model (and optimizer) entries into `model`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict,
                                                         set_model_state_dict,
                                                         set_optimizer_state_dict)

    from ..sharding.surface.param_access import is_sharded_param
    from ..sharding.step.whole_view import is_dtensor

    if any(is_sharded_param(p) and not is_dtensor(p) for p in model.parameters()):
        raise CheckpointError(
            f"{directory} is a torch DCP checkpoint, and this model's parameters are this rank's "
            "rows without a DeviceMesh (XLA's device threads), which torch's state-dict API "
            "cannot lay out. HINT: load it where torch process groups run (cpu, cuda, xpu) and "
            "save it with shardkit.checkpoint.save, which every backend reads")
    keys = set(FileSystemReader(directory).read_metadata().state_dict_metadata)
    model_sd = get_model_state_dict(model)
    names = list(model_sd)
    model_prefix = find_prefix(keys, names, strict)
    if model_prefix is None:
        shown = ", ".join(sorted(keys)[:6]) + (" ..." if len(keys) > 6 else "")
        missing = [n for n in names if not any(k == n or k.endswith("." + n) for k in keys)]
        raise StateDictMismatchError(
            f"torch DCP checkpoint {directory} does not hold this model's entries under one "
            f"prefix: {len(missing)} of {len(names)} names are missing (e.g. "
            f"{', '.join(missing[:3])}); it holds {shown}. HINT: strict=False loads the entries "
            "both have (a new head on a pretrained trunk)")
    state: dict = {}
    model_entries = _nest(state, model_prefix, model_sd)
    if optimizer is None:
        dcp.load(state, checkpoint_id=directory,
                 planner=DefaultLoadPlanner(allow_partial_load=not strict))
    else:
        found = find_optimizer_prefix(keys, [n for n, _ in model.named_parameters()])
        if found is None:
            raise StateDictMismatchError(
                f"torch DCP checkpoint {directory} holds no optimizer state for this model's "
                "parameters (no '<prefix>state.<name>.<key>' entries). HINT: load the model alone "
                "(shardkit.checkpoint.load(path, model)) and start the optimizer afresh")
        optim_prefix, flattened = found
        optim_options = StateDictOptions(flatten_optimizer_state_dict=flattened)
        optim_sd = get_optimizer_state_dict(model, optimizer, options=optim_options)
        optim_entries = _nest(state, optim_prefix, optim_sd)
        dcp.load(state, checkpoint_id=directory,
                 planner=DefaultLoadPlanner(allow_partial_load=not strict))
        if optim_entries is state:  # dcp.load replaced non-tensor entries in `state` itself
            optim_entries = {k: state[k] for k in optim_sd}
        set_optimizer_state_dict(model, optimizer, optim_entries, options=optim_options)
    if model_entries is state:
        model_entries = {name: state[name] for name in names}
    set_model_state_dict(model, model_entries, options=StateDictOptions(strict=strict))
