"""Compute seconds per unit, measured on one rank, for the step-time model (steptime.py)."""

from __future__ import annotations

import statistics
import time
import warnings
from typing import Callable

import torch
from torch import nn

from .steptime import UnitTimes


def _synchronize() -> None:
    # Kernels on an accelerator are asynchronous: a host timer needs them finished.
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        accelerator.synchronize()


class _Stopwatch:
    """Host timestamps at every unit's forward and backward edges."""

    def __init__(self, units: list[nn.Module]) -> None:
        self.units = units
        self.forward = [0.0] * len(units)
        self.backward = [0.0] * len(units)
        self._started: dict[tuple[str, int], float] = {}
        self.handles = []
        # The root is timed around the whole forward and backward by the caller: its output
        # may be no tensor, and a loss computed outside it is still its step's work.
        for i, unit in enumerate(units[:-1]):
            self.handles += [
                unit.register_forward_pre_hook(lambda *_, i=i: self._start("f", i)),
                unit.register_forward_hook(lambda *_, i=i: self._stop("f", i)),
                unit.register_full_backward_pre_hook(lambda *_, i=i: self._start("b", i)),
                unit.register_full_backward_hook(lambda *_, i=i: self._stop("b", i)),
            ]

    def _start(self, phase: str, i: int) -> None:
        _synchronize()
        self._started[(phase, i)] = time.perf_counter()

    def _stop(self, phase: str, i: int) -> None:
        _synchronize()
        spent = time.perf_counter() - self._started.pop((phase, i))
        (self.forward if phase == "f" else self.backward)[i] += spent

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def measure_unit_times(units: list[nn.Module], forward: Callable[[], torch.Tensor],
                       optimizer_step: Callable[[], None] | None = None,
                       repeats: int = 5) -> UnitTimes:
    """Median forward / backward seconds of each unit's own ops (nested units subtracted).

    `units` are the engine's units in its order, root last (shardkit.sharding.setup.plan.plan_units),
    of a model that is not sharded; `forward` runs one forward and returns the loss. The root's
    share is the whole forward (loss included) or backward less the other units'. A unit whose
    inputs need no gradient (a first layer fed raw data) has its backward counted in the root's:
    autograd gives its hooks nothing to wait for."""
    samples: list[tuple[list[float], list[float], float]] = []
    for repeat in range(repeats + 1):  # the first step warms caches and lazy state
        watch = _Stopwatch(units)
        try:
            _synchronize()
            began = time.perf_counter()
            loss = forward()
            _synchronize()
            forward_total = time.perf_counter() - began
            began = time.perf_counter()
            with warnings.catch_warnings():  # that case, said in the docstring
                warnings.filterwarnings("ignore", "Full backward hook is firing")
                loss.backward()
            _synchronize()
            backward_total = time.perf_counter() - began
        finally:
            watch.remove()
        began = time.perf_counter()
        if optimizer_step is not None:
            optimizer_step()
        _synchronize()
        step_s = time.perf_counter() - began
        if repeat:
            samples.append((_exclusive(units, watch.forward[:-1] + [forward_total]),
                            _exclusive(units, watch.backward[:-1] + [backward_total]), step_s))
    median = lambda values: statistics.median(values)  # noqa: E731
    return UnitTimes(tuple(median([s[0][i] for s in samples]) for i in range(len(units))),
                     tuple(median([s[1][i] for s in samples]) for i in range(len(units))),
                     median([s[2] for s in samples]))


def _exclusive(units: list[nn.Module], inclusive: list[float]) -> list[float]:
    """Each unit's time less the time of the units directly inside it."""
    inside = [{id(m) for m in unit.modules()} for unit in units]
    out = list(inclusive)
    for j, unit in enumerate(units):
        # The innermost other unit containing this one is the one whose time includes it.
        parents = [i for i in range(len(units)) if i != j and id(unit) in inside[i]]
        if parents:
            out[min(parents, key=lambda i: len(inside[i]))] -= inclusive[j]
    return [max(t, 0.0) for t in out]
