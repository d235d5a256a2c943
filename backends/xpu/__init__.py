"""The Intel XPU backend (xccl or oneCCL's ccl). Full implementation lands with the accelerator backends issue."""

from __future__ import annotations

import torch

from shardkit import Backend, Capabilities, hookimpl


class XPUBackend(Backend):
    """Intel GPUs through torch.xpu."""

    name = "xpu"
    device_type = "xpu"
    priority = 20
    capabilities = Capabilities(has_streams=True)

    @classmethod
    def is_available(cls) -> bool:
        """True when torch sees an XPU."""
        return hasattr(torch, "xpu") and torch.xpu.is_available()

    @classmethod
    def unavailable_reason(cls) -> str:
        """No XPU visible to this torch build."""
        return f"torch {torch.__version__} sees no Intel XPU device"

    @classmethod
    def requirement_hint(cls) -> str:
        """Install torch's XPU build."""
        return ("pip install 'shardkit[xpu]' with torch's XPU build "
                "(pip install torch --index-url https://download.pytorch.org/whl/xpu) on a machine "
                "with an Intel GPU and driver")

    def local_device(self, local_rank: int) -> torch.device:
        """One XPU per local rank."""
        return torch.device("xpu", local_rank % max(torch.xpu.device_count(), 1))

    def device_count(self) -> int:
        """Visible XPUs."""
        return torch.xpu.device_count()

    def process_group_backend(self) -> str:
        """Native xccl."""
        return "xccl"


@hookimpl
def shardkit_register_backends(registry):
    """Register the XPU backend."""
    registry.add(XPUBackend)
