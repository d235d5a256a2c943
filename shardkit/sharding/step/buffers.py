"""Reuse of flat communication buffers where execution is host-ordered (no streams).

On such devices (CPU) every fresh multi-hundred-megabyte buffer is new memory from the OS whose
pages fault in on first touch, which costs as much as the copies themselves. A buffer whose
collective has been waited on is free to reuse immediately, so a few buffers are kept and
handed out again. With streams a buffer may still be in use by queued work, and the device's
caching allocator already reuses memory, so the pool stays off there.
"""

from __future__ import annotations

from typing import Callable

import torch


class BufferPool:
    """A handful of reusable 1-D buffers per (dtype, device).

    `release` (Backend.free_storage where storage resizes) frees a buffer the pool drops in
    place: a collective library's idle worker thread may still reference the tensor of its last
    collective (gloo's held one into the next step's peak), and must not hold its memory."""

    def __init__(self, enabled: bool, max_buffers: int,
                 release: Callable[[torch.Tensor], None] | None = None) -> None:
        self.enabled = enabled
        self.max_buffers = max_buffers
        self.release = release
        self._free: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Return a 1-D tensor of `numel` elements (uninitialised), reusing a kept buffer if one fits."""
        if self.enabled:
            free = self._free.get((dtype, torch.device(device)), [])
            # Only buffers up to twice the request: a small unit must not take the buffer the
            # largest unit will ask for next, or that one would be allocated afresh after all.
            fits = [i for i, b in enumerate(free) if numel <= b.numel() <= 2 * numel]
            if fits:
                best = free.pop(min(fits, key=lambda i: free[i].numel()))
                return best[:numel]
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, buffer: torch.Tensor) -> None:
        """Hand back a buffer from take() once no collective or copy uses it any more."""
        if not self.enabled:
            return
        base = buffer._base if buffer._base is not None else buffer
        free = self._free.setdefault((base.dtype, base.device), [])
        # The same buffer, not the same address: tensors without memory (meta) all have 0 there.
        if any(b is base for b in free):
            return
        free.append(base)
        if len(free) > self.max_buffers:
            # Keep the large ones: fresh small buffers are cheap, fresh large ones fault in slowly.
            self._drop(free.pop(min(range(len(free)), key=lambda i: free[i].numel())))

    def clear(self) -> None:
        """Drop every kept buffer."""
        for buffers in self._free.values():
            for buffer in buffers:
                self._drop(buffer)
        self._free.clear()

    def _drop(self, buffer: torch.Tensor) -> None:
        if self.release is not None:
            self.release(buffer)
