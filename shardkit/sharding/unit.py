"""A sharding unit: the parameters gathered together, and its unshard / reshard / reduce runtime."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from .collectives import (PendingGather, PendingReduce, copy_out, divide_factors, finish_reduce,
                          pack_grads, start_all_gather, start_reduce_scatter)
from .param import ShardedParam
from .trace import trace_range

if TYPE_CHECKING:
    from .state import ShardState


def _buckets(params: list[ShardedParam], key) -> dict[torch.dtype, list[ShardedParam]]:
    # One flat collective per dtype: a flat buffer holds a single dtype.
    out: dict[torch.dtype, list[ShardedParam]] = {}
    for p in params:
        out.setdefault(key(p), []).append(p)
    return out


class ShardUnit:
    """Parameters of one wrapped module (minus those of nested units), gathered and reduced as one."""

    def __init__(self, state: "ShardState", module: nn.Module, name: str,
                 params: list[ShardedParam],
                 buffers: list[tuple[nn.Module, str]] | None = None) -> None:
        self.state = state
        self.buffers = buffers or []
        self._stashed_buffers: list[tuple[nn.Module, str, torch.Tensor]] = []
        self.module = module
        self.name = name or "<root>"
        self.params = params
        self.gather_buckets = _buckets(params, lambda p: p.compute_dtype)
        trainable = [p for p in params if p.requires_grad]
        self.reduce_buckets = _buckets(trainable, lambda p: state.config.reduce_dtype(p.master_dtype))
        self.is_unsharded = False  # the unsharded params hold gathered values
        self.registered_unsharded = False
        self.pending: list[tuple[list[ShardedParam], PendingGather]] = []
        self.forward_uses = 0  # forward calls with grad-requiring inputs whose backward is due
        self.needs_post_backward = False
        self.backward_started = False  # pre-backward ran in this backward pass
        # Profiler range names, built once (formatting them per call would cost on the hot path).
        self.trace_names = {k: f"shardkit::{k}[{self.name}]"
                            for k in ("pre_forward", "post_forward", "pre_backward",
                                      "post_backward", "unshard", "wait_unshard", "reduce")}

    def __repr__(self) -> str:
        return f"<ShardUnit {self.name} params={len(self.params)}>"

    # ---- gather ----------------------------------------------------------------------------
    @property
    def in_flight(self) -> bool:
        """True while an all-gather for this unit has been issued but not consumed."""
        return bool(self.pending)

    def unshard(self, async_op: bool = True) -> None:
        """Issue this unit's all-gather(s) unless its params are gathered or already in flight."""
        if self.is_unsharded or self.pending:
            return
        st = self.state
        async_op = async_op and st.async_collectives
        with trace_range(self.trace_names["unshard"]):
            for dtype, params in self.gather_buckets.items():
                pending = start_all_gather(params, dtype, st.device, st.shard_group, st.backend,
                                           st.stats, async_op=async_op,
                                           stream=st.gather_stream, pool=st.pool)
                self.pending.append((params, pending))

    def wait_for_unshard(self) -> None:
        """Make the unsharded params hold the gathered values (issuing the gather if needed)."""
        if self.is_unsharded:
            return
        if not self.pending:
            self.unshard(async_op=False)
        st = self.state
        with trace_range(self.trace_names["wait_unshard"]):
            for params, pending in self.pending:
                pending.wait(st.backend, st.device)
                for p in params:
                    p.alloc_unsharded()
                copy_out(params, pending.output, [p.unsharded_flat for p in params],
                         st.shard_group.size)
                st.pool.give(pending.output)
        self.pending = []
        if st.needs_compiler_barrier:
            st.backend.compiler_barrier([p.unsharded for p in self.params])
        self.is_unsharded = True

    def reshard(self) -> None:
        """Free the gathered params (and drop a prefetched gather nobody used)."""
        for _params, pending in self.pending:
            pending.wait(self.state.backend, self.state.device)  # buffers must outlive it
            self.state.pool.give(pending.output)
        self.pending = []
        if self.is_unsharded:
            if self.state.needs_compiler_barrier:
                self.state.backend.compiler_barrier([p.unsharded for p in self.params])
            for p in self.params:
                p.free_unsharded()
            self.is_unsharded = False

    def register(self, unsharded: bool) -> None:
        """Expose the compute (unsharded) or optimizer (sharded) params on the modules."""
        if self.registered_unsharded != unsharded:
            for p in self.params:
                p.register(unsharded)
            self.registered_unsharded = unsharded

    # ---- gradients -------------------------------------------------------------------------
    def reduce_grads(self) -> list[PendingReduce]:
        """Start the reduce-scatter of every trainable param's unsharded grad; return the handles."""
        st = self.state
        started = []
        with trace_range(self.trace_names["reduce"]):
            for dtype, params in self.reduce_buckets.items():
                pre, post = divide_factors(st.dp_size, dtype)
                grads = [p.take_unsharded_grad() for p in params]
                inp = pack_grads(params, grads, dtype, st.device, st.shard_group.size, pre,
                                 st.pool)
                # The full-size grads are dead once packed: free them before the collective
                # runs (it may allocate its own temporaries).
                del grads
                started.append(start_reduce_scatter(params, inp, st.device, st.shard_group,
                                                     st.backend, st.stats, post,
                                                     stream=st.reduce_stream))
        return started

    def finish(self, pending: PendingReduce) -> None:
        """Complete one of this unit's reductions into the sharded grads."""
        finish_reduce(pending, self.state.replica_group, self.state.backend, self.state.stats,
                      self.state.pool)

    # ---- buffers under MixedPrecision.buffer_dtype --------------------------------------------
    def cast_buffers(self, dtype: torch.dtype) -> None:
        """Swap floating buffers for `dtype` copies for the duration of forward."""
        for module, name in self.buffers:
            buf = module._buffers.get(name)
            if buf is not None and torch.is_floating_point(buf) and buf.dtype != dtype:
                self._stashed_buffers.append((module, name, buf))
                module._buffers[name] = buf.to(dtype)

    def restore_buffers(self) -> None:
        """Put the original-dtype buffers back, keeping updates forward made (running stats)."""
        with torch.no_grad():
            for module, name, original in self._stashed_buffers:
                original.copy_(module._buffers[name])
                module._buffers[name] = original
        self._stashed_buffers = []
