"""Per-model engine state: context, groups, units, execution order and the backward finaliser."""

from __future__ import annotations

from typing import Any, Iterable, cast

import torch

from ...backend import Backend
from ...handles import Group
from .buffers import BufferPool
from .comms import CrossGroupReduce, PendingReduce
from .traffic import CommStats
from ..policies import ShardConfig
from .trace import trace_range
from .unit import ShardUnit


class ShardState:
    """Everything one sharded model needs at run time; stored on the root module, never global."""

    def __init__(self, backend: Backend, device: torch.device, world: Group, shard_group: Group,
                 replica_group: Group | None, config: ShardConfig,
                 ranks_per_node: int | None = None) -> None:
        self.backend = backend
        self.device = device  # compute device
        self.world = world
        self.shard_group = shard_group
        self.replica_group = replica_group
        # (node group, group across nodes) of a shard group spanning nodes, for the two-hop
        # quantized gradient reduction (setup/groups.make_node_hops); None: one hop.
        self.node_hops: tuple[Group, Group] | None = None
        # Under fault_tolerance=: the all-reduce across replica groups (a torchft Manager,
        # fault_tolerance/cross_groups.py); None otherwise.
        self.cross_groups: CrossGroupReduce | None = None
        # A user's all-gather / reduce-scatter (model.set_custom_all_gather / _reduce_scatter,
        # FSDP2's interface), which every unit's collectives use instead of the built-in.
        self.custom_all_gather: Any = None
        self.custom_reduce_scatter: Any = None
        self.config = config
        caps = backend.capabilities
        self.async_collectives = caps.async_collectives
        self.needs_compiler_barrier = caps.needs_compiler_barrier
        self.stats = CommStats(ranks_per_node)
        # Separate streams let gathers and reductions overlap compute (null objects without streams).
        self.gather_stream = backend.devices.new_stream(device)
        self.reduce_stream = backend.devices.new_stream(device)
        # Enough for the gathers in flight (prefetch + the one in use) and one reduction input.
        self.pool = BufferPool(enabled=not caps.has_streams, max_buffers=config.prefetch + 2,
                               release=backend.devices.free_storage if caps.supports_storage_resize
                               else None)
        self.units: list[ShardUnit] = []  # root unit last
        self.root_unit: ShardUnit | None = None
        self.forward_order: list[ShardUnit] = []  # pre-forward order seen in the first iteration
        self.post_forward_order: list[ShardUnit] = []
        self.order_recorded = False
        self.recording = False
        self.no_sync = False
        self.keep_unsharded = 0  # depth of model.unshard() contexts
        self.warned_state_dict = False  # state_dict() of this model has warned (state_dict_hooks.py)
        self.finalizer_queued = False
        self.reductions: list[tuple[ShardUnit, PendingReduce]] = []

    @property
    def strategy_name(self) -> str:
        """The strategy's name, e.g. "FULL_SHARD"."""
        return self.config.strategy.name

    # ---- iteration boundaries ------------------------------------------------------------
    def on_root_pre_forward(self) -> None:
        """Start an iteration: drop gathers an optimizer step may have made stale; record order."""
        if not self.keep_unsharded and not any(u.needs_post_backward for u in self.units):
            # No backward is pending, so nothing needs the gathered params any more; what a
            # no-grad forward (SHARD_GRAD_OP) or an unused prefetch left behind may predate
            # an optimizer step.
            for unit in self.units:
                unit.to_sharded()
        if not self.order_recorded and not self.recording and torch.is_grad_enabled():
            self.recording = True

    def on_root_post_forward(self) -> None:
        """Stop recording once the first full forward finished."""
        if self.recording:
            self.recording = False
            self.order_recorded = True

    def record_pre_forward(self, unit: ShardUnit) -> None:
        """Remember the order units first run in, for forward prefetch."""
        if self.recording and unit not in self.forward_order:
            self.forward_order.append(unit)

    def record_post_forward(self, unit: ShardUnit) -> None:
        """Remember the order units finish forward; backward runs roughly in reverse."""
        if self.recording and unit not in self.post_forward_order:
            self.post_forward_order.append(unit)

    # ---- prefetch --------------------------------------------------------------------------
    def prefetch_forward(self, unit: ShardUnit) -> None:
        """In `unit`'s pre-forward: its explicit forward prefetch list, else the bounded order."""
        if unit.forward_prefetch is not None:
            self.prefetch_units(unit.forward_prefetch, skip_done=False)
        elif self.order_recorded:
            self.prefetch_after(unit, self.forward_order, skip_done=False)

    def prefetch_backward(self, unit: ShardUnit) -> None:
        """In `unit`'s pre-backward: its explicit backward prefetch list, else the bounded order."""
        if unit.backward_prefetch is not None:
            self.prefetch_units(unit.backward_prefetch, skip_done=True)
        else:
            self.prefetch_after(unit, self.backward_order(), skip_done=True)

    def prefetch_units(self, units: list[ShardUnit], skip_done: bool) -> None:
        """Issue the all-gathers of exactly `units` (set_*_prefetch), skipping those not needed."""
        for nxt in units:
            if (skip_done and nxt.backward_started) or nxt.is_unsharded or nxt.in_flight:
                continue
            nxt.unshard(async_op=True)
            self.stats.note_in_flight(sum(1 for u in self.units if u.in_flight))

    def prefetch_after(self, unit: ShardUnit, order: list[ShardUnit], skip_done: bool) -> None:
        """Issue the all-gathers of the next units in `order`, keeping at most `prefetch` in flight."""
        limit = self.config.prefetch
        if limit <= 0 or unit not in order:
            return
        in_flight = sum(1 for u in self.units if u.in_flight)
        for nxt in order[order.index(unit) + 1:]:
            if in_flight >= limit:
                return
            if skip_done and nxt.backward_started:
                continue
            if nxt.is_unsharded or nxt.in_flight:
                continue
            nxt.unshard(async_op=True)
            in_flight += 1
            self.stats.note_in_flight(in_flight)

    def backward_order(self) -> list[ShardUnit]:
        """Units in the order backward reaches them: the reverse of their post-forward order."""
        return list(reversed(self.post_forward_order))

    # ---- backward ----------------------------------------------------------------------------
    def queue_finalizer(self) -> None:
        """Ask autograd to run finalize_backward once the current backward pass ends."""
        if not self.finalizer_queued:
            self.finalizer_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finalize_backward)

    def post_backward(self, unit: ShardUnit) -> None:
        """Reduce one unit's grads (unless in no_sync) and reshard it."""
        with trace_range(unit.trace_names["post_backward"]):
            self._post_backward(unit)

    def _post_backward(self, unit: ShardUnit) -> None:
        unit.reduction_taken()
        # Free the gathered params first: the reduce-scatter input then takes their place in
        # memory instead of adding to it (the grads are separate tensors).
        if not self.keep_unsharded:
            unit.to_sharded()
        if not self.no_sync:
            # Finish the previous unit's reductions before packing this one, so at most one
            # full-size reduce input exists at a time and the pool can hand its buffer on.
            self.wait_reductions()
            started = unit.reduce_grads()
            self.reductions.extend((unit, r) for r in started)

    def wait_reductions(self) -> None:
        """Finish every reduction in flight into the sharded grads."""
        pending, self.reductions = self.reductions, []
        for unit, reduction in pending:
            unit.finish(reduction)

    def finalize_backward(self) -> None:
        """Run at the end of backward: reduce what hooks did not, wait, reshard, reset counters."""
        try:
            for unit in reversed(self.units):
                if unit.needs_post_backward:
                    self.post_backward(unit)
            self.wait_reductions()
            for unit in self.units:
                if not self.keep_unsharded:
                    unit.to_sharded()
        finally:
            for unit in self.units:
                unit.pass_done()
            self.finalizer_queued = False

    def iter_params(self) -> Iterable:
        """Every ShardedParam of the model, unit by unit."""
        for unit in self.units:
            yield from unit.params

    def params_by_fqn(self) -> dict:
        """Every name a sharded parameter has (tied ones have several) -> its ShardedParam."""
        return {fqn: sp for sp in self.iter_params() for fqn in sp.fqns}


def state_of(unit: ShardUnit) -> ShardState:
    """The ShardState that owns and drives `unit` (the unit itself sees only its UnitRuntime)."""
    return cast(ShardState, unit.state)  # every unit is made by a ShardState (api._make_units)
