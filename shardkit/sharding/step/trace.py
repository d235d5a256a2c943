"""Named profiler ranges (`shardkit::...`) that cost one boolean check when no profiler runs."""

from __future__ import annotations

from contextlib import nullcontext
from typing import ContextManager

from torch.autograd import _profiler_enabled
from torch.profiler import record_function

_NOTHING = nullcontext()


def trace_range(name: str) -> ContextManager:
    """A `record_function(name)` range while a profiler records, else a shared no-op context."""
    # record_function enters a dispatcher op even with no profiler; skipping it keeps the hot
    # path free of that call (about a microsecond each, dozens per unit per step).
    return record_function(name) if _profiler_enabled() else _NOTHING
