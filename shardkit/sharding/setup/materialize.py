"""Materialise a meta-device model one module at a time, sharding each parameter once initialised.

Modules are visited in registration order (how `__init__` usually creates them) and each one's
own parameters get real memory on the compute device, are initialised with `param_init_fn(module)`
or `module.reset_parameters()`, and are handed to `on_ready` to be sharded as soon as every module
holding them has been initialised. Peak extra memory is therefore about one module's parameters,
and with the same seed the values equal those of an eager model built from leaf modules.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ...errors import ShardkitError


def has_meta(module: nn.Module) -> bool:
    """True when any parameter or buffer of the model lives on the meta device."""
    tensors = list(module.parameters()) + list(module.buffers())
    return any(t.device.type == "meta" for t in tensors)


def materialize(root: nn.Module, device: torch.device,
                param_init_fn: Callable[[nn.Module], object] | None, initialise: bool,
                on_ready: Callable[[nn.Parameter, nn.Parameter], None]) -> None:
    """Give every meta tensor real, initialised memory; call on_ready(meta_param, real_param).

    initialise=False leaves the new tensors as they are (a device whose tensors hold no values)."""
    owners_left: dict[int, int] = {}
    for module in root.modules():
        for p in module._parameters.values():
            if p is not None and p.device.type == "meta":
                owners_left[id(p)] = owners_left.get(id(p), 0) + 1
    real: dict[int, nn.Parameter] = {}
    metas: dict[int, nn.Parameter] = {}
    for name, module in root.named_modules():
        touched = False
        for attr, p in list(module._parameters.items()):
            if p is None or (p.device.type != "meta" and id(p) not in real):
                continue
            if id(p) in real:  # a tied parameter another module already materialised
                module._parameters[attr] = real[id(p)]
                continue
            touched = True
            new = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
            real[id(p)] = new
            real[id(new)] = new
            metas[id(new)] = p
            module._parameters[attr] = new
        for attr, b in list(module._buffers.items()):
            if b is not None and b.device.type == "meta":
                touched = True
                module._buffers[attr] = torch.empty_like(b, device=device)
        if touched and initialise:
            _init_module(name, module, param_init_fn)
        for p in list(module._parameters.values()):
            if p is None or id(p) not in metas:
                continue
            meta = metas[id(p)]
            owners_left[id(meta)] -= 1
            if owners_left[id(meta)] == 0:
                on_ready(meta, p)


def _init_module(name: str, module: nn.Module,
                 param_init_fn: Callable[[nn.Module], object] | None) -> None:
    if param_init_fn is not None:
        param_init_fn(module)
    elif callable(reset := getattr(module, "reset_parameters", None)):
        with torch.no_grad():
            reset()
    else:
        raise ShardkitError(
            f"module {name or '<root>'} ({type(module).__name__}) has meta-device tensors but no "
            "reset_parameters(); HINT: pass param_init_fn=fn to shardkit.shard(), where "
            "fn(module) initialises that module's own parameters and buffers")
