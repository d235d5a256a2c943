"""`shardkit plan ... --measure`: train the planned step on this machine and set the measured
peak beside the planned one.

A plan is an upper bound by construction (planner/rehearsal.py), and this is how a user checks
it on their own device in one command: the ranks build the same model (really, on the device),
shard it with the same options, train two steps with the same optimizer, and report the
allocator's high-water mark over the second step (forward, backward, optimizer.step):
`max_memory_allocated` on an accelerator, torch's own allocation count (the profiler's
memory events) on the host, where the process's resident size would count far more than
tensors. host_memory_profiler() is that count with every thread's frees in it (the tests'
measurements use it too).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from ..errors import ShardkitError
from ..logs import logger

_WINDOW = "shardkit::measured_step"


@dataclass(frozen=True)
class ModelSource:
    """The model as the command line named it, rebuilt in each rank (on the meta device)."""

    hf_config: str | None
    overrides: tuple[str, ...]
    factory: str | None
    wrap_names: tuple[str, ...]  # the units' class names (a policy of the user's classes
    # would need their module importable before the rank has put the working directory on
    # its path)

    def build(self, device: str = "meta") -> torch.nn.Module:
        """The model, built on `device`."""
        from .models import from_factory, from_hf_config, hf_config

        if self.hf_config is not None:
            return from_hf_config(hf_config(self.hf_config, self.overrides), device)
        assert self.factory is not None
        return from_factory(self.factory, device)


@dataclass(frozen=True)
class MeasureSpec:
    """What each rank needs to build, shard and train the planned model (all picklable)."""

    source: ModelSource
    shard_kwargs: dict[str, Any]  # shard()'s options but the units
    activation_checkpointing: bool
    optimizer: str
    batch: int
    seq: int


def measured_peak(rank: int, spec: MeasureSpec) -> dict[str, int]:
    """This rank's allocator high-water mark over its second training step, in bytes."""
    from ..job.runtime import current_context
    from ..sharding.api import shard
    from ..sharding.surface.recipes import checkpoint_layers
    from .activations import model_loss, token_inputs
    from .models import wrap_by_class_names
    from .rehearsal import OPTIMIZERS

    ctx = current_context()
    assert ctx is not None  # spawn() initialised this rank
    on_host = ctx.device.type == "cpu"
    # Started before the model exists: the running total is then every tensor this rank holds.
    with host_memory_profiler() if on_host else contextlib.nullcontext() as profiler:
        torch.manual_seed(0)  # every rank builds the same values (shard() compares them)
        model = spec.source.build("cpu")  # built and initialised on the host, then sharded
        policy = wrap_by_class_names(model, spec.source.wrap_names)
        layers = tuple({type(m) for m in model.modules()
                        if type(m).__name__ in spec.source.wrap_names})
        model = shard(model, auto_wrap_policy=policy, **spec.shard_kwargs)
        if spec.activation_checkpointing and layers:
            checkpoint_layers(model, layers)
        optimizer = OPTIMIZERS[spec.optimizer.lower()](
            [p for p in model.parameters() if p.requires_grad])
        args, kwargs = token_inputs(model)(spec.batch, spec.seq)
        args = tuple(torch.zeros_like(a, device=ctx.device) for a in args)
        kwargs = {k: torch.zeros_like(v, device=ctx.device) if isinstance(v, torch.Tensor) else v
                  for k, v in kwargs.items()}

        def step() -> None:
            model_loss(model(*args, **kwargs)).backward()
            optimizer.step()

        step()
        optimizer.zero_grad()
        ctx.backend.devices.synchronize(ctx.device)
        ctx.backend.devices.reset_peak_memory(ctx.device)
        if on_host:
            from torch.autograd.profiler import record_function

            with record_function(_WINDOW):
                step()
        else:
            step()
            ctx.backend.devices.synchronize(ctx.device)
    if on_host:
        return {"peak": _peak_in_window(profiler)}
    return {"peak": int(ctx.backend.devices.memory_stats(ctx.device)["peak"])}


@contextlib.contextmanager
def host_memory_profiler() -> Iterator[Any]:
    """torch's profiler recording host allocations, with the frees of every thread counted."""
    from torch.profiler import ProfilerActivity, profile

    with _frees_counted_on_every_thread(), \
            profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield prof


# torch's CPU allocator keeps its running total (each memory event's "Total Allocated") only
# for the allocations and frees of threads the profiler traces, unless this c10 flag is set.
# A collective library's own thread often frees a tensor: gloo's worker drops a finished
# collective's work (and the last reference to its tensors, when the caller let go of them
# first) a moment after the caller's wait() returned. Untraced, that free is never subtracted
# and every later total over-counts the tensor: one rank of a planner test once measured
# 14,228,992 bytes too many, the buffer shard() compares replicas with (issue 55).
_EVERY_THREAD_FLAG = "FLAGS_caffe2_report_cpu_memory_usage"


@contextlib.contextmanager
def _frees_counted_on_every_thread() -> Iterator[None]:
    flag = _c10_bool_flag(_EVERY_THREAD_FLAG)
    if flag is None:
        logger.warning("this torch build exports no %s, so a tensor freed on a collective "
                       "library's thread stays counted: measured host peaks may read high",
                       _EVERY_THREAD_FLAG)
        yield
        return
    before = flag.value
    flag.value = True
    try:
        yield
    finally:
        flag.value = before


def _c10_bool_flag(name: str) -> Any:
    """A boolean gflag of torch's c10 library, writable in place (ctypes), or None."""
    import ctypes
    import sys

    library = {"win32": "c10.dll", "darwin": "libc10.dylib"}.get(sys.platform, "libc10.so")
    try:
        c10 = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", library))
        return ctypes.c_bool.in_dll(c10, name)
    except (OSError, ValueError):
        return None


def trace_events(prof: Any) -> list[dict]:
    """A finished profiler's events as its Chrome trace lists them (memory events carry the
    allocator's running total there, which the profiler's Python events do not)."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]
    finally:
        os.remove(path)


def _peak_in_window(prof: Any) -> int:
    """The most bytes torch's CPU allocator held during the measured step."""
    events = trace_events(prof)
    (window,) = [e for e in events if e.get("name") == _WINDOW and e.get("ph") == "X"]
    start, end = window["ts"], window["ts"] + window["dur"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"
              and start <= e["ts"] <= end]
    if not totals:
        raise ShardkitError("--measure: the profiler recorded no allocation in the measured step")
    return max(totals)


def compare(planned: int, measured: list[dict[str, int]], device: str) -> tuple[str, bool]:
    """The report's lines and whether every rank stayed within the plan."""
    from .result import _size

    lines = [f"measured on this machine ({device}, {len(measured)} rank(s), torch "
             f"{torch.__version__}): each rank's allocator peak over its second step"]
    held = True
    for rank, got in enumerate(measured):
        peak = got["peak"]
        held = held and peak <= planned
        lines.append(f"rank {rank}: planned {_size(planned)}, measured {_size(peak)} "
                     f"(planned / measured {planned / max(peak, 1):.3f})")
    lines.append("the plan held on every rank" if held else
                 "the plan was EXCEEDED: please report it with this output "
                 "(shardkit's planner promises an upper bound)")
    return "\n".join(lines), held
