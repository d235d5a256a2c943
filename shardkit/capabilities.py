"""What a backend can do, as data the engine branches on instead of backend names."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Callable

import torch

from .errors import ShardkitError
from .kernel_workspace import KernelCall, cpu_kernel_workspace

FLOAT_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16})
EXACT_REDUCE_OPS = frozenset({"avg", "premul_sum"})  # what exact_reduce_ops may name


@dataclass(frozen=True)
class AttentionCall:
    """What decides a device's scaled_dot_product_attention kernel, read off one call (the
    planner asks Capabilities.fused_attention, since fused kernels keep far less for backward)."""

    dtype: torch.dtype
    dropout: bool = False  # dropout_p > 0
    masked: bool = False  # an attn_mask is passed (is_causal alone is not a mask)
    mask_needs_grad: bool = False  # ... and it requires a gradient (T5's learned position bias)
    grouped_query: bool = False  # fewer key/value heads than query heads (enable_gqa)
    head_dim: int = 64


def fused_attention_on_cpu(call: AttentionCall) -> bool:
    """torch's CPU attention: fused unless attention dropout or a mask that needs a gradient
    sends it to the math path (the fused kernel shares grouped key/value heads itself)."""
    return not call.dropout and not call.mask_needs_grad


@dataclass(frozen=True)
class Capabilities:
    """Static facts about a backend that the engine needs to choose a code path."""

    # Separate compute/communication streams exist, so prefetch overlaps through events.
    has_streams: bool = False
    # Collectives can return before completion (a Work handle to wait on later).
    async_collectives: bool = True
    # A tensor's storage can be resized to 0 and back (FSDP2-style free); XLA tensors have none.
    supports_storage_resize: bool = True
    # Shards are padded (in whole rows) towards a multiple of shard_alignment elements per rank
    # where that costs less than shard_alignment elements (sharding/step/layout.py).
    shard_alignment: int = 1
    # Parameters of at least this many elements get collectives of their own, gathered straight
    # into their storage and reduced straight from their gradient (sharding/step/buckets.py): worth one
    # more call where a full-size copy costs as much as the collective (host memory). None: never.
    direct_collective_numel: int | None = None
    # The compiler may hoist or keep gathered params alive unless a barrier pins them (XLA).
    needs_compiler_barrier: bool = False
    # A graph must be cut after the optimizer step (XLA's mark_step / sync).
    needs_step_boundary: bool = False
    # Several ranks may live as threads of one process (XLA on CPU): no process-global state.
    ranks_share_process: bool = False
    # Collectives run on a torch.distributed process group, which torch.distributed.checkpoint can
    # coordinate through and a DeviceMesh can be built on (parameters are then DTensors of the
    # whole parameter, every strategy: sharding/step/whole_view.py); False: checkpoints are
    # written from host copies of the shards instead, and parameters are plain rows (RowParams).
    torch_process_group: bool = True
    # Reduce ops the collectives accept for general use (the engine's own reductions use "sum").
    reduce_ops: frozenset[str] = frozenset({"sum", "max", "min"})
    # Averaging ops the collectives compute exactly (within the dtype's rounding of the true mean):
    # "avg" and/or "premul_sum" (a sum of inputs pre-scaled by a factor). The engine averages
    # gradients with them instead of "sum" + a divide kernel; the conformance suite checks each
    # one numerically. Empty: the engine sums and divides itself.
    exact_reduce_ops: frozenset[str] = frozenset()
    supported_dtypes: frozenset[torch.dtype] = field(default=FLOAT_DTYPES)
    # Why torch.compile of a unit is refused on this device ("" where it is supported): a unit's
    # .compile() and compile_layers raise it instead of compiling something that misbehaves.
    compile_refusal: str = ""
    # How long a rank waits on a silent peer before failing when the user sets no timeout: an
    # accelerator job may keep peers waiting for minutes (first compile, autotune), a host job not.
    default_timeout: datetime.timedelta = datetime.timedelta(minutes=10)
    # Which scaled_dot_product_attention calls run a fused kernel on this device (it keeps its
    # output and log-sum-exp for backward, not the math path's S x S scores): the planner reads
    # it from the class, so a machine without the device plans for it. A pure function of the
    # call; Backend.runs_fused_attention answers with it, and the conformance suite checks that.
    fused_attention: Callable[[AttentionCall], bool] = fused_attention_on_cpu
    # What the device's allocator holds above the tensors alive at the peak, as a fraction of
    # them (a caching allocator reserves blocks it does not hand back): "what fits" plans a
    # budget of device_memory / (1 + allocator_headroom). 0 where memory is what tensors hold.
    allocator_headroom: float = 0.0
    # Scratch bytes a kernel allocates for itself while an op runs (kernel_workspace.py): the
    # planner's rehearsal adds them at that op. A pure function of the call that errs high.
    kernel_workspace: Callable[[KernelCall], int] = cpu_kernel_workspace
    # Bytes the device's libraries hold once the first kernels ran (cuBLAS's workspaces come
    # from CUDA's caching allocator), added to every planned peak.
    library_workspace_bytes: int = 0
    # A share of the rehearsed peak added for what no rule covers (a kernel's small scratch):
    # the planner's peak errs high by this much and no more.
    peak_margin: float = 0.01
    # A finished collective's tensors may stay referenced by the library's own threads for a
    # while after wait() returned (torch's process-group work objects): a gradient the engine let go
    # can outlive its step. The planner then adds the largest tensor one reduction took.
    collective_tensors_linger: bool = False
    # Tensors hold values. False only for the planner's rehearsal (planner/rehearsal.py: the real
    # engine on the meta device, collectives that move nothing), where shard() skips what reads
    # values or asks the peers: initialising, copying rank 0's values, comparing replicas.
    holds_values: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.allocator_headroom < 10.0:
            raise ShardkitError(f"Capabilities.allocator_headroom is a fraction of the allocated "
                                f"bytes in [0, 10), got {self.allocator_headroom}")
        if not 0.0 <= self.peak_margin < 1.0 or self.library_workspace_bytes < 0:
            raise ShardkitError(f"Capabilities.peak_margin is a fraction in [0, 1) and "
                                f"library_workspace_bytes a byte count >= 0, got "
                                f"{self.peak_margin} and {self.library_workspace_bytes}")
        if self.direct_collective_numel is not None and self.direct_collective_numel < 1:
            raise ShardkitError(f"Capabilities.direct_collective_numel must be None or >= 1, got "
                                f"{self.direct_collective_numel}")
        unknown = self.exact_reduce_ops - EXACT_REDUCE_OPS
        if unknown:
            raise ShardkitError(f"Capabilities.exact_reduce_ops names {sorted(unknown)}; it may "
                                f"only name {sorted(EXACT_REDUCE_OPS)}")

    def describe(self) -> dict[str, object]:
        """Return a JSON-friendly dict of the flags, for `shardkit info`."""
        return {
            "has_streams": self.has_streams,
            "async_collectives": self.async_collectives,
            "supports_storage_resize": self.supports_storage_resize,
            "shard_alignment": self.shard_alignment,
            "direct_collective_numel": self.direct_collective_numel,
            "needs_compiler_barrier": self.needs_compiler_barrier,
            "needs_step_boundary": self.needs_step_boundary,
            "ranks_share_process": self.ranks_share_process,
            "torch_process_group": self.torch_process_group,
            "reduce_ops": sorted(self.reduce_ops),
            "exact_reduce_ops": sorted(self.exact_reduce_ops),
            "default_timeout_s": self.default_timeout.total_seconds(),
            "supported_dtypes": sorted(str(d).replace("torch.", "") for d in self.supported_dtypes),
            "compile_refusal": self.compile_refusal,
            "allocator_headroom": self.allocator_headroom,
            "holds_values": self.holds_values,
            "kernel_workspace": getattr(self.kernel_workspace, "__qualname__",
                                        repr(self.kernel_workspace)),
            "library_workspace_bytes": self.library_workspace_bytes,
            "peak_margin": self.peak_margin,
            "collective_tensors_linger": self.collective_tensors_linger,
            "fused_attention": getattr(self.fused_attention, "__qualname__", repr(self.fused_attention)),
        }
