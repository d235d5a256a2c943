"""The XLA backend (TPU, or CPU with PJRT_DEVICE=CPU). Full implementation lands with the accelerator backends issue."""

from __future__ import annotations

import importlib.util
import os

import torch

from shardkit import Backend, Capabilities, hookimpl


class XLABackend(Backend):
    """XLA devices through torch_xla's PJRT runtime."""

    name = "xla"
    device_type = "xla"
    priority = 10
    capabilities = Capabilities(has_streams=False, supports_storage_resize=False,
                                shard_alignment=128, needs_compiler_barrier=True,
                                needs_step_boundary=True, ranks_share_process=True)

    @classmethod
    def is_available(cls) -> bool:
        """True when torch_xla is importable."""
        return importlib.util.find_spec("torch_xla") is not None

    @classmethod
    def unavailable_reason(cls) -> str:
        """torch_xla is not installed."""
        return "torch_xla is not installed"

    @classmethod
    def auto_select_now(cls) -> bool:
        """Only when PJRT_DEVICE says which XLA device to use: torch_xla must not hijack other boxes."""
        return bool(os.environ.get("PJRT_DEVICE"))

    @classmethod
    def requirement_hint(cls) -> str:
        """torch_xla must match torch exactly."""
        return "pip install 'shardkit[xla]' (torch_xla needs the torch of the same version, e.g. torch==2.9.0 torch_xla==2.9.0)"

    def local_device(self, local_rank: int) -> torch.device:
        """The device torch_xla assigned to this process or thread."""
        import torch_xla

        return torch_xla.device()

    def device_count(self) -> int:
        """Addressable XLA devices."""
        import torch_xla.runtime as xr

        return xr.addressable_runtime_device_count()

    def process_group_backend(self) -> str:
        """torch_xla's process group."""
        return "xla"


@hookimpl
def shardkit_register_backends(registry):
    """Register the XLA backend."""
    registry.add(XLABackend)
