"""A rank's piece of a sharded model's optimizer state, and the full state put back together.

Plain torch + shardkit: the default lane's checkpoint tests and the XLA lane's workers both use it.
"""

from __future__ import annotations

import torch

from shardkit.sharding import shard_views


def local_optim(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    """This rank's optimizer state on the host: ({(fqn, key): (offset, real part, padding)}, {fqn: step})."""
    pieces, steps, seen = {}, {}, set()
    for v in shard_views(model):
        if id(v.param) in seen:  # a tied parameter appears under each of its names
            continue
        seen.add(id(v.param))
        for key, value in opt.state[v.param].items():
            if key == "step":
                steps[v.fqn] = float(value)
            else:
                value = v.as_rows(value.detach()).cpu().reshape(-1)  # padded rows; flat offsets
                pieces[(v.fqn, key)] = (v.offset, value[:v.valid_numel].clone(),
                                        value[v.valid_numel:].clone())
    return pieces, steps


def assemble_optim(per_rank: list[tuple[dict, dict]]) -> tuple[dict, dict]:
    """Full flattened optimizer state and the steps from every rank's local_optim (replicas write equal data).

    An element no rank holds stays NaN, so a caller can check that the pieces cover every element.
    """
    full: dict = {}
    steps: dict = {}
    for pieces, rank_steps in per_rank:
        steps.update(rank_steps)
        for key, (offset, real, _) in pieces.items():
            if real.numel() == 0:  # a rank whose shard of this parameter is all padding
                continue
            end = offset + real.numel()
            t = full.setdefault(key, torch.full((0,), float("nan")))
            if t.numel() < end:
                t = torch.cat([t, torch.full((end - t.numel(),), float("nan"))])
            t[offset:end] = real
            full[key] = t
    return full, steps
