"""The collectives shardkit's engine issues in one step, per unit, with no batch and no compute.

An independent reference for the planner's bytes (issue 52 item 4): a meta copy is sharded under
the planner's rehearsal backend (collectives that move nothing) and every unit module's forward is
replaced by a stand-in that sums its own parameters and calls its child units, so one forward and
backward drives the engine's own hooks as a training step does (forward gathers with prefetch,
reshard after forward, backward regathers, reduce-scatters, the replicas' all-reduce, int8
all-to-alls in one or two hops). Each unit's strategies log their calls as they issue them.
"""

from __future__ import annotations

import copy
import types
from typing import Any

import torch
from torch import nn

from shardkit.handles import Group
from shardkit.launch_env import LaunchEnv

Call = tuple[str, int, int]  # (the planner's call kind, bytes as CommStats counts them, ranks)


def engine_schedule(model: nn.Module, world: int, capabilities: Any, ranks_per_node: int | None = None,
                    **shard_kwargs: Any) -> tuple[dict, dict[str, list[Call]]]:
    """comm_stats of the second stand-in step, and each unit's calls in it, by the plan's unit label."""
    from shardkit.job.runtime import DistContext, acting_context
    from shardkit.planner.rehearsal import RehearsalBackend
    from shardkit.sharding import comm_stats, shard
    from shardkit.sharding.setup.reshard import unit_label
    from shardkit.sharding.step.hooks import unit_of

    backend = RehearsalBackend(capabilities, world)
    env = LaunchEnv(0, world, 0, ranks_per_node or world, "127.0.0.1", None, "test")
    context = DistContext(backend, env, torch.device("meta"), Group(0, world, tuple(range(world))))
    with torch.device("meta"):
        twin = copy.deepcopy(model).to("meta")
    log: dict[str, list[Call]] = {}
    with acting_context(context):
        twin = shard(twin, **shard_kwargs)
        units = {m: unit_label(name) for name, m in twin.named_modules() if unit_of(m) is not None}
        for module, (own, children) in _unit_tree(twin, units).items():
            module.forward = types.MethodType(_stand_in(own, children), module)
        _step(twin)  # lazy init may choose a unit's strategies anew: log from the second step
        comm_stats(twin, reset=True)
        for module, label in units.items():
            unit = unit_of(module)
            _log(unit.collectives, log.setdefault(label, []), unit.state.shard_group.size, set())
        _step(twin)
        return comm_stats(twin), log


def _step(twin: nn.Module) -> None:
    out = twin()
    if out is not None and out.requires_grad:
        out.backward()
    twin.zero_grad(set_to_none=True)


def _unit_tree(model: nn.Module, units: dict) -> dict:
    tree = {model: ([model], [])}

    def walk(module: nn.Module, owner: nn.Module) -> None:
        for child in module.children():
            if child in units:
                tree[owner][1].append(child)
                tree[child] = ([child], [])
                walk(child, child)
            else:
                tree[owner][0].append(child)
                walk(child, owner)

    walk(model, model)
    return tree


def _stand_in(own: list, children: list):
    def forward(self, *args, **kwargs):
        total = None
        for module in own:  # the gathered parameters, exposed by the engine for the forward
            for p in module._parameters.values():
                if p is not None and p.requires_grad:
                    total = p.sum() if total is None else total + p.sum()
        for child in children:
            out = child()
            if out is not None:
                total = out if total is None else total + out
        return total

    return forward


def _log(strategy: Any, calls: list[Call], shard_group: int, seen: set) -> None:
    if strategy is None or id(strategy) in seen:
        return
    seen.add(id(strategy))
    stats = getattr(strategy, "stats", None)
    if stats is not None and not isinstance(stats, _Logged):
        strategy.stats = _Logged(stats, calls, shard_group)
    for name in ("gather", "regather", "scatter", "replica"):
        _log(getattr(strategy, name, None), calls, shard_group, seen)


class _Logged:
    """The model's CommStats, also logging each call as the planner names it."""

    def __init__(self, stats: Any, calls: list[Call], shard_group: int) -> None:
        self._stats, self._calls, self._shard_group, self._group = stats, calls, shard_group, None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stats, name)

    def crosses_node(self, group: Group) -> bool:
        self._group = group
        return self._stats.crosses_node(group)

    def peers_elsewhere(self, group: Group) -> int:
        self._group = group
        return self._stats.peers_elsewhere(group)

    def all_gather(self, shard_bytes, group_size, crosses_node=False, kind="all_gather"):
        self._stats.all_gather(shard_bytes, group_size, crosses_node, kind=kind)
        if kind == "all_gather":  # autograd runs a graph task while backward runs
            kind = "backward_gather" if torch._C._current_graph_task_id() != -1 else "forward_gather"
        else:
            kind = "all_reduce_gather"
        self._calls.append((kind, shard_bytes, group_size))

    def reduce_scatter(self, shard_bytes, group_size, crosses_node=False):
        self._stats.reduce_scatter(shard_bytes, group_size, crosses_node)
        self._calls.append(("reduce_scatter", shard_bytes, group_size))

    def all_reduce(self, nbytes, group_size, crosses_node=False):
        self._stats.all_reduce(nbytes, group_size, crosses_node)
        self._calls.append(("all_reduce", nbytes, group_size))

    def all_to_all(self, kind, chunk_bytes, group_size, peers_elsewhere=0):
        self._stats.all_to_all(kind, chunk_bytes, group_size, peers_elsewhere)
        if kind == "all_reduce":
            logged = "a2a_all_reduce"
        elif group_size == self._shard_group:
            logged = "a2a_reduce_scatter"
        else:  # two hops: inside the node (consecutive ranks), then across the nodes
            ranks = self._group.ranks if self._group is not None else ()
            logged = "a2a_node" if all(b - a == 1 for a, b in zip(ranks, ranks[1:])) else "a2a_across"
        self._calls.append((logged, chunk_bytes, group_size))
