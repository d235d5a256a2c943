"""Per-rank memory figures for the demo: what this rank holds versus what one unsharded copy needs."""

from __future__ import annotations

import torch

from ..planner.optimizers import STATE_TENSORS_PER_PARAM
from ..sharding.surface.param_access import held_numel
from ..sharding.step.whole_view import local_of

MB = 1024 * 1024


def unsharded_state_bytes(num_params: int, optimizer: str, dtype_bytes: int = 4) -> int:
    """Formula for one unsharded fp32 training copy: params + grads + optimizer states."""
    return num_params * dtype_bytes * (2 + STATE_TENSORS_PER_PARAM[optimizer])


def _nbytes(t: torch.Tensor) -> int:
    # A sharded parameter's grad and optimizer state are DTensors of the whole shape: what this
    # rank holds is their local rows.
    return local_of(t).numel() * t.element_size()


def _param_nbytes(p: torch.Tensor) -> int:
    # The engine keeps a parameter's shard as padded rows (the DTensor views the real ones), and
    # its gradient is a view of the padded reduce output: both hold shard_numel elements.
    return held_numel(p) * p.element_size()


def measured_state_bytes(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank really holds in the parameters, gradients and state its optimizer owns."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    states = [t for p in params for t in optimizer.state.get(p, {}).values()
              if isinstance(t, torch.Tensor) and t.shape == p.shape]
    out = {"params": sum(_param_nbytes(p) for p in params),
           "grads": sum(_param_nbytes(p) for p in params if p.grad is not None),
           "optimizer": sum(_nbytes(t) for t in states)}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def memory_report(results: list[dict], device_kind: str) -> str:
    """A small table of each rank's memory figures, in MB, for printing after training."""
    peak_label = "peak RSS" if device_kind == "cpu" else "peak allocated"
    header = (f"{'rank':>4}  {'sharded state (measured)':>24}  {'unsharded state (formula)':>25}"
              f"  {peak_label + ' (measured)':>24}  {'before model':>12}")
    lines = ["memory per rank, MB (state = params + grads + optimizer states):", header]
    for r in results:
        mem = r["memory"]
        lines.append(f"{r['rank']:>4}  {mem['state_bytes'] / MB:>24.1f}  "
                     f"{mem['unsharded_formula_bytes'] / MB:>25.1f}  "
                     f"{mem['peak_bytes'] / MB:>24.1f}  {mem['start_bytes'] / MB:>12.1f}")
    return "\n".join(lines)
