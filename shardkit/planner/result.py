"""What `shardkit.plan()` returns: per-unit rows and per-rank totals, as text or JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class UnitRow:
    """One sharding unit as the engine would build it, with its per-rank sizes."""

    name: str  # the engine's unit name ("<root>" for the root module)
    params: int  # elements of the unit's parameters (each distinct parameter once)
    trainable: int  # elements of those that require grad
    padded_numel: int  # sum of the parameters' padded flat sizes (padding counted)
    shard_numel: int  # elements each rank of the shard group owns (sum of padded shards)
    persistent_bytes: int  # params + grads + optimizer state this unit keeps per rank
    unsharded_bytes: int  # the gathered unit (padded flat buffers) in compute dtype
    grad_bytes: int  # the unit's full-size gradients in compute dtype during backward
    reshard_after_forward: bool | int  # what happens after forward: True, False or group of k
    reduce_bytes: int = 0  # the flat reduce-scatter input of its trainable gradients
    grad_shard_bytes: int = 0  # the reduced gradient shard each rank keeps
    # Its collectives in the order the engine issues them: (kind, bytes, group size); kind one of
    # forward_gather, backward_gather, reduce_scatter, all_reduce; bytes as comm_stats counts
    # them: a gather's input shard, a reduce-scatter's output shard, an all-reduce's buffer.
    collectives: tuple[tuple[str, int, int], ...] = ()


@dataclass(frozen=True)
class Plan:
    """Memory and traffic of one training step per rank, predicted from the model's shapes.

    `peak_bytes` estimates the device memory high-water mark as: persistent device bytes
    + the root unit gathered with its full gradients (it stays gathered through forward and
    backward) + the (1 + prefetch) largest other units gathered with their full gradients (the
    one computing and the prefetched ones; the reduce-scatter input is taken to reuse the
    gathered params' place) + what the other units keep between forward and backward
    (SHARD_GRAD_OP / reshard_after_forward=False: the whole unsharded unit; an int k: its 1/k
    slice). Activations, autograd temporaries and allocator fragmentation are NOT included.

    Given a batch (plan(..., batch=, seq=)), `peak_bytes` is instead the high-water mark of the
    second of two training steps (forward, backward, optimizer.step) that shardkit.shard() and
    the optimizer actually ran on a meta-device copy of the model (planner/rehearsal.py: every
    tensor the engine, autograd and the optimizer kept, the engine's buffers and pooled buffers,
    activation checkpointing's recomputation), plus `margin_bytes` for what no tensor shows:
    kernel scratch by the target backend's rule at each op, its libraries' workspaces and its
    declared share of the peak (Capabilities.kernel_workspace, library_workspace_bytes,
    peak_margin). It is meant as an upper bound of the allocator's max_memory_allocated over a
    step. `step_bytes` is what the step adds above the shards and optimizer state. What the
    caching allocator reserves beyond that is "what fits"'s headroom (fit.py).
    """

    world_size: int
    strategy: str
    shard_group_size: int
    replica_group_size: int
    shard_alignment: int
    optimizer: str
    param_dtype: str  # the compute dtype ("" when each parameter computes in its own dtype)
    reduce_dtype: str
    cpu_offload: bool
    prefetch: int
    units: tuple[UnitRow, ...]
    param_count: int
    trainable_count: int
    persistent: dict[str, int]  # params / grads / optimizer / total bytes per rank
    persistent_device: int  # of which on the compute device
    persistent_host: int  # of which in host memory (cpu_offload)
    largest_unit: str
    largest_unit_bytes: int  # the transient the largest gathered unit adds
    peak_bytes: int  # see the class docstring for what it includes
    comm: dict[str, Any]  # bytes sent per rank per step, keyed like shardkit.comm_stats()
    batch: int | None = None  # per rank, when the step was simulated
    seq: int | None = None
    activation_checkpointing: bool = False
    step_bytes: int | None = None  # see the class docstring
    margin_bytes: int | None = None  # of peak_bytes: added for what the rehearsal cannot see
    quantized: str = ""  # what travels as int8 blocks (shardkit.Quantization), "" for nothing
    # fault_tolerant=True: the copy of its shards and optimizer state a rejoining rank receives
    # (host memory; inside peak_bytes where the device is the host): planner/recovery.py
    recovery_bytes: int = 0
    # tp=: torch's tensor parallelism inside over this many ranks (world_size = tp x data
    # parallel); the groups and comm above are the data-parallel dimension's, comm["tp"] TP's.
    tensor_parallel: int = 1
    tp_plan: str = ""  # where the TP plan came from

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-friendly builtins (units as a list of dicts)."""
        out = asdict(self)
        out["param_dtype"] = self.param_dtype or None  # None: each parameter computes as stored
        out["units"] = [asdict(u) for u in self.units]
        return out

    def _peak_line(self) -> str:
        """The peak: with the simulated step when a batch was given, else without activations."""
        if self.step_bytes is None:
            return (f"estimated peak per rank: {_size(self.peak_bytes)} on the device (activations "
                    "not included; give --batch and --seq to include them)")
        shape = f"batch {self.batch}" + (f" x seq {self.seq}" if self.seq else "")
        ac = ", activation checkpointing" if self.activation_checkpointing else ""
        return (f"peak per rank at {shape}{ac}: {_size(self.peak_bytes)} on the device = "
                f"shards and optimizer state {_size(self.peak_bytes - self.step_bytes)} + step "
                f"{_size(self.step_bytes)} (activations, temporaries, gathered units, gradients; "
                f"the engine rehearsed on meta; {_size(self.margin_bytes or 0)} of it a margin "
                "for kernel workspaces)")

    def table(self) -> str:
        """A readable text table: one line per unit, then per-rank totals."""
        layout = "" if self.tensor_parallel == 1 else (
            f" = tensor parallel {self.tensor_parallel} x data parallel "
            f"{self.world_size // self.tensor_parallel}")
        tp_plan = f"; TP plan: {self.tp_plan}" if self.tensor_parallel > 1 else ""
        head = (f"shardkit plan: {self.param_count:,} params ({self.trainable_count:,} trainable), "
                f"{self.strategy} on {self.world_size} rank(s){layout} (shard group "
                f"{self.shard_group_size}, replicas {self.replica_group_size}){tp_plan}\n"
                f"compute {self.param_dtype or 'as stored'}, reduce "
                f"{self.reduce_dtype or 'as stored'}, optimizer {self.optimizer}"
                f"{', cpu_offload' if self.cpu_offload else ''}, prefetch {self.prefetch}"
                f"{', int8 blocks: ' + self.quantized if self.quantized else ''}")
        rows = _collapsed(self.units)
        width = max([4] + [len(r[0]) for r in rows])
        cols = f"{'unit':<{width}} {'params/unit':>14} {'shard/rank':>13} {'persist/rank':>13} {'gathered':>11}  reshard"
        lines = [head, "", cols, "-" * len(cols)]
        for u in rows:
            lines.append(f"{u[0]:<{width}} {u[1]:>14,} {u[2]:>13,} {_size(u[3]):>13} {_size(u[4]):>11}  {u[5]}")
        p = self.persistent
        lines += ["",
                  f"persistent per rank: {_size(p['total'])} = params {_size(p['params'])} + grads "
                  f"{_size(p['grads'])} + optimizer {_size(p['optimizer'])} (device "
                  f"{_size(self.persistent_device)}, host {_size(self.persistent_host)})",
                  f"largest gathered unit: {self.largest_unit} ({_size(self.largest_unit_bytes)})",
                  self._peak_line(),
                  f"sent per rank per step{', data parallel' if self.tensor_parallel > 1 else ''}"
                  f": {_traffic(self.comm)}"]
        if self.tensor_parallel > 1:
            lines.append(self._tensor_parallel_line())
        if "inter_node_by_rank" in self.comm:
            lines.append(self._inter_node_line())
        if self.recovery_bytes:
            lines.append(f"fault tolerant: a rejoining rank receives {_size(self.recovery_bytes)} "
                         "(its shards and optimizer state, held in host memory until loaded; "
                         "in the peak where the device is the host)")
        return "\n".join(lines)

    def _tensor_parallel_line(self) -> str:
        """TP's own collectives: counted from the rehearsed step, so only with a batch."""
        if self.comm.get("tp") is None:
            return ("sent per rank per step, tensor parallel: activations, not counted without a "
                    "step (give --batch and --seq)")
        return f"sent per rank per step, tensor parallel (rehearsed): {_traffic(self.comm['tp'])}"

    def _inter_node_line(self) -> str:
        per_rank = [r["total"] for r in self.comm["inter_node_by_rank"]]
        shown = ", ".join(f"rank {i} {_size(b)}" for i, b in enumerate(per_rank[:8]))
        more = f", ... ({len(per_rank)} ranks)" if len(per_rank) > 8 else ""
        return (f"sent to another node per step ({self.comm['nodes']} nodes, ring order; "
                f"all-to-alls by peer): {_size(sum(per_rank))} in all; {shown}{more}")


def _traffic(comm: dict[str, Any]) -> str:
    """"total = kind bytes (calls) + ..." for a comm dict of CommStats' form."""
    kinds = list(COLLECTIVES) + [k for k in ("all_to_all", "broadcast") if k in comm]
    return f"{_size(comm['total'])} = " + " + ".join(
        f"{k} {_size(comm[k])} ({comm['calls'].get(k, 0)} calls)" for k in kinds)


def _row_key(u: UnitRow) -> tuple:
    return (u.params, u.shard_numel, u.persistent_bytes, u.unsharded_bytes, u.reshard_after_forward)


def _collapsed(units: tuple[UnitRow, ...]) -> list[tuple]:
    """Rows for the table, runs of identical consecutive units (the layers) folded into one."""
    out: list[tuple] = []
    i = 0
    while i < len(units):
        u, j = units[i], i
        while j + 1 < len(units) and _row_key(units[j + 1]) == _row_key(u):
            j += 1
        name = u.name if j == i else f"{u.name}..{units[j].name} (x{j - i + 1})"
        out.append((name, u.params, u.shard_numel, u.persistent_bytes, u.unsharded_bytes,
                    u.reshard_after_forward))
        i = j + 1
    return out


def _size(nbytes: float) -> str:
    """Bytes in binary units with three significant figures (e.g. 1.23 GiB)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{int(value)} B"
            # 999.5-1023.x would read "1e+03" in three significant figures: whole units there.
            return f"{value:.3g} {unit}" if abs(value) < 999.5 else f"{value:.0f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
