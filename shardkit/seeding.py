"""`shardkit.seeded(seed)`: build the same model on every rank, also where ranks are threads.

torch's default random generator is process-global. When ranks are processes, seeding before
building gives every rank the same initial values. When ranks are threads of one process (XLA on
PJRT-CPU), one rank's `torch.manual_seed` can land while another rank is half-way through drawing
its weights, and ranks (or runs) silently differ. `seeded` holds one process-wide lock around
seed-and-build, so each rank draws its numbers alone: the same values as a single-process build.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

_BUILD_LOCK = threading.RLock()


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seed torch's RNG and keep other threads' `seeded` blocks out until this one ends."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seeded() takes an int seed, got {seed!r}")
    with _BUILD_LOCK:
        torch.manual_seed(seed)
        yield
