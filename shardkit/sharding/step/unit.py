"""A sharding unit: the parameters gathered together, and its unshard / reshard / reduce runtime."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn
from typing_extensions import override

from ...handles import Group
from .buckets import Bucket, collective_buckets
from .collectives import copy_out
from .comms import CommRuntime, PendingGather, PendingReduce, UnitCollectives, choose
from .lifecycle import (SHARDED_MOVES, TRAINING_MOVES, ShardedState, TrainingState, advance)
from .param import ShardedParam
from ..policies import ShardConfig
from .trace import trace_range


class UnitRuntime(CommRuntime, Protocol):
    """What a unit reads from its model's runtime state (state.ShardState, which owns and drives
    the units), beyond what its collectives read: declared here, so the unit needs nothing from
    the module above it."""

    config: ShardConfig
    node_hops: tuple[Group, Group] | None  # a shard group's two hops across nodes, or None
    custom_all_gather: Any  # a user's comms (model.set_custom_all_gather / _reduce_scatter)
    custom_reduce_scatter: Any
    async_collectives: bool
    needs_compiler_barrier: bool


class ShardUnit:
    """Parameters of one wrapped module (minus those of nested units), gathered and reduced as one."""

    def __init__(self, state: UnitRuntime, module: nn.Module, name: str,
                 params: list[ShardedParam],
                 buffers: list[tuple[nn.Module, str]] | None = None,
                 reshard_after_forward: bool | int | None = None,
                 reshard_group: Group | None = None, free_without_backward: bool = False) -> None:
        self.state = state
        self.buffers = buffers or []
        self._stashed_buffers: list[tuple[nn.Module, str, torch.Tensor]] = []
        self.module = module
        self.name = name or "<root>"
        self.params = params
        direct = state.backend.capabilities.direct_collective_numel
        self.gather_buckets = collective_buckets(params, lambda p: p.compute_dtype, direct)
        trainable = [p for p in params if p.requires_grad]
        self.reduce_buckets = collective_buckets(
            trainable, lambda p: state.config.reduce_dtype(p.master_dtype), direct)
        # How this unit's gathers and reductions move their bytes (exact, int8 blocks, in two
        # hops, a user's own): chosen here, once; the step code below never asks which.
        self.collectives: UnitCollectives = self.choose_collectives()
        self.sharded_state = ShardedState.SHARDED
        self.training_state = TrainingState.IDLE
        self.pending: list[tuple[list[ShardedParam], PendingGather]] = []
        # True: free after forward; False: keep gathered; int k: keep a 1/k slice (reshard.py).
        self.reshard_after_forward = (state.config.reshard_after_forward
                                      if reshard_after_forward is None else reshard_after_forward)
        self.reshard_group = reshard_group  # the k-rank group of an int reshard_after_forward
        # Kept for backward only because it is the root (reshard.py): freed when none follows.
        self.free_without_backward = free_without_backward
        self.partial_rows: dict[int, torch.Tensor] = {}  # per gather bucket index, in PARTIAL
        self.gathered_over = state.shard_group.size  # ranks the pending all-gathers span
        # None: the bounded `prefetch=` order; a list: exactly these units (set_*_prefetch).
        self.forward_prefetch: list[ShardUnit] | None = None
        self.backward_prefetch: list[ShardUnit] | None = None
        self.forward_uses = 0  # forward calls with grad-requiring inputs whose backward is due
        # >0 while a registered forward method runs the unit's hooks around itself: its own
        # forward, called inside (a training_step calling self(x)), must not run them again.
        self.in_forward_method = 0
        self.graph_key = ""  # how traced.py's custom ops name this unit (hooks.install sets it)
        self.traceable = False  # whether dynamo may trace its hooks (traced.traced_refusal)
        # Profiler range names, built once (formatting them per call would cost on the hot path).
        self.trace_names = {k: f"shardkit::{k}[{self.name}]"
                            for k in ("pre_forward", "post_forward", "pre_backward",
                                      "post_backward", "unshard", "wait_unshard", "reduce")}

    def choose_collectives(self) -> UnitCollectives:
        """This unit's collective strategies from the model's settings (and a user's comms)."""
        st = self.state
        quant = st.config.quantization
        chosen = choose(st, quant.block_size if quant.weights else 0,
                        quant.block_size if quant.gradients else 0, st.node_hops,
                        st.custom_all_gather, st.custom_reduce_scatter)
        for bucket in self.reduce_buckets:
            chosen.plan(bucket.dtype)  # decided once, before the first step
        return chosen

    @override
    def __repr__(self) -> str:
        return f"<ShardUnit {self.name} params={len(self.params)}>"

    # ---- lifecycle ---------------------------------------------------------------------------
    def _move(self, new: ShardedState) -> None:
        self.sharded_state = advance(self.name, self.sharded_state, new, SHARDED_MOVES)

    def _train(self, new: TrainingState) -> None:
        self.training_state = advance(self.name, self.training_state, new, TRAINING_MOVES)

    @property
    def in_flight(self) -> bool:
        """True while an all-gather for this unit has been issued but not consumed."""
        return self.sharded_state is ShardedState.GATHERING

    @property
    def is_unsharded(self) -> bool:
        """True while the unsharded params hold gathered values (exposed or kept)."""
        return self.sharded_state in (ShardedState.UNSHARDED, ShardedState.KEPT)

    @property
    def needs_post_backward(self) -> bool:
        """True while a forward's reduction is still due."""
        return self.training_state in (TrainingState.FORWARD, TrainingState.PRE_BACKWARD)

    @property
    def backward_started(self) -> bool:
        """True once this backward pass reached the unit."""
        return self.training_state in (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD)

    def forward_ran(self) -> None:
        """A forward whose outputs need grad finished: its reduction is now due."""
        if not self.needs_post_backward:
            self._train(TrainingState.PRE_BACKWARD if self.backward_started
                        else TrainingState.FORWARD)

    def backward_reached(self) -> None:
        """Backward reached the unit's outputs."""
        self._train(TrainingState.PRE_BACKWARD if self.needs_post_backward
                    else TrainingState.POST_BACKWARD)

    def reduction_taken(self) -> None:
        """The unit's post-backward ran: nothing is left to reduce this pass."""
        self._train(TrainingState.POST_BACKWARD)

    def pass_done(self) -> None:
        """The backward pass is over: back to idle."""
        self.forward_uses = 0
        self._train(TrainingState.IDLE)

    # ---- transitions of the parameters -------------------------------------------------------
    def unshard(self, async_op: bool = True) -> None:
        """Issue this unit's all-gather(s) (SHARDED or PARTIAL -> GATHERING); else a no-op.

        From PARTIAL the gather runs inside the k-rank group, from the slices kept after forward.
        """
        if self.sharded_state not in (ShardedState.SHARDED, ShardedState.PARTIAL):
            return
        st = self.state
        async_op = async_op and st.async_collectives
        rows, self.partial_rows = self.partial_rows, {}
        group = self.reshard_group if rows else st.shard_group
        assert group is not None  # PARTIAL is only entered with a k-rank group
        self.gathered_over = group.size
        with trace_range(self.trace_names["unshard"]):
            for i, bucket in enumerate(self.gather_buckets):
                into = None
                if bucket.direct:
                    bucket.params[0].alloc_unsharded()
                    into = bucket.params[0].unsharded_flat
                pending = self.collectives.start_gather(bucket.params, bucket.dtype, group,
                                                        async_op, source=rows.get(i), into=into)
                self.pending.append((bucket.params, pending))
        self._move(ShardedState.GATHERING)

    def to_unsharded(self) -> None:
        """Gather (waiting on a prefetch if one is in flight) and expose the full params."""
        if self.sharded_state is ShardedState.UNSHARDED:
            return
        if not self.is_unsharded:
            self._fill_unsharded()
        self._expose(unsharded=True)
        self._move(ShardedState.UNSHARDED)

    def to_kept(self) -> None:
        """Expose the shards but keep the gathered values for backward (SHARD_GRAD_OP)."""
        if self.sharded_state is ShardedState.KEPT:
            return
        self._expose(unsharded=False)
        self._move(ShardedState.KEPT)

    def after_forward(self, backward_follows: bool = True) -> None:
        """Reshard as reshard_after_forward says: free (True), keep (False), keep 1/k (int k)."""
        if self.reshard_after_forward is True or (self.free_without_backward and not backward_follows):
            self.to_sharded()
        elif self.reshard_after_forward is False:
            self.to_kept()
        else:
            self.to_partial()

    def to_partial(self) -> None:
        """Keep this rank's 1/k slice of each gathered param, free the rest, expose the shards."""
        if self.sharded_state is ShardedState.PARTIAL:
            return
        group = self.reshard_group
        assert group is not None and self.sharded_state is ShardedState.UNSHARDED
        self._expose(unsharded=False)
        for i, bucket in enumerate(self.gather_buckets):
            # The slice of a padded flat viewed (k, padded/k) at this rank's block position is
            # exactly its row of the k-rank all-gather backward will issue.
            self.partial_rows[i] = torch.cat(
                [p.unsharded_flat.view(group.size, -1)[group.rank] for p in bucket.params])
        if self.state.needs_compiler_barrier:
            self.state.backend.devices.compiler_barrier([*self.partial_rows.values(),
                                                 *(p.unsharded for p in self.params)])
        for p in self.params:
            p.free_unsharded()
        self._move(ShardedState.PARTIAL)

    def to_sharded(self) -> None:
        """Expose the shards and free the gathered params (dropping a gather nobody used)."""
        if self.sharded_state is ShardedState.SHARDED:
            return
        self._expose(unsharded=False)
        self.partial_rows = {}
        for params, pending in self.pending:
            pending.wait(self.state.backend, self.state.device)  # buffers must outlive it
            if pending.into_storage:
                for p in params:
                    p.free_unsharded()
            else:
                self.collectives.release(pending)
        self.pending = []
        if self.is_unsharded:
            if self.state.needs_compiler_barrier:
                self.state.backend.devices.compiler_barrier([p.unsharded for p in self.params])
            for p in self.params:
                p.free_unsharded()
        self._move(ShardedState.SHARDED)

    def _expose(self, unsharded: bool) -> None:
        for p in self.params:
            p.register(unsharded)

    def _fill_unsharded(self) -> None:
        if not self.pending:
            self.unshard(async_op=False)
        st = self.state
        with trace_range(self.trace_names["wait_unshard"]):
            for params, pending in self.pending:
                pending.wait(st.backend, st.device)
                if pending.into_storage:
                    continue  # gathered straight into the param's own storage
                for p in params:
                    p.alloc_unsharded()
                copy_out(params, pending.output, [p.unsharded_flat for p in params],
                         self.gathered_over)
                self.collectives.release(pending)
        self.pending = []
        if st.needs_compiler_barrier:
            st.backend.devices.compiler_barrier([p.unsharded for p in self.params])

    # ---- gradients -------------------------------------------------------------------------
    def reduce_grads(self) -> list[PendingReduce]:
        """Start the reduce-scatter of every trainable param's unsharded grad; return the handles."""
        with trace_range(self.trace_names["reduce"]):
            return [self._reduce_bucket(bucket) for bucket in self.reduce_buckets]

    def _reduce_bucket(self, bucket: Bucket[ShardedParam]) -> PendingReduce:
        grads = [p.take_unsharded_grad() for p in bucket.params]  # emptied once packed
        return self.collectives.start_reduce(bucket.params, grads, bucket.dtype, bucket.direct)

    def finish(self, pending: PendingReduce) -> None:
        """Complete one of this unit's reductions into the sharded grads."""
        self.collectives.finish_reduce(pending)

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
                current = module._buffers[name]
                assert current is not None, name  # cast_buffers put a tensor there
                original.copy_(current)
                module._buffers[name] = original
        self._stashed_buffers = []
