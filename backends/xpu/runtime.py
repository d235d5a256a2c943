"""What this torch install offers an Intel GPU: the device module and the two collective stacks.

Everything the XPU backend learns about the machine goes through one `XpuRuntime` object, so the
tests can hand the backend a stand-in and check every decision on a machine without an XPU.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from typing import Any

import torch

BINDINGS_MODULE = "oneccl_bindings_for_pytorch"
IPEX_MODULE = "intel_extension_for_pytorch"
INTEL_INDEX = "https://pytorch-extension.intel.com/release-whl/stable/xpu/us/"
TORCH_XPU_INDEX = "https://download.pytorch.org/whl/xpu"


class XpuRuntime:
    """Facts from the real torch install (torch.xpu, xccl, the legacy oneCCL bindings)."""

    def device_module(self) -> Any:
        """Return torch.xpu, or None when this torch has no XPU module at all."""
        return getattr(torch, "xpu", None)

    def xccl_available(self) -> bool:
        """True when torch.distributed was built with the native xccl backend (torch >= 2.8 XPU wheels)."""
        import torch.distributed as dist

        probe = getattr(dist, "is_xccl_available", None)
        return bool(dist.is_available() and probe is not None and probe())

    def ccl_installed(self) -> bool:
        """True when the legacy oneCCL bindings can be imported (without importing them)."""
        return importlib.util.find_spec(BINDINGS_MODULE) is not None

    def load_ccl(self) -> None:
        """Import the legacy stack; importing the bindings registers the "ccl" process-group backend."""
        # The legacy bindings expect IPEX to have set up the XPU runtime first (oneCCL's own example
        # imports it before the bindings); newer torch has torch.xpu natively, so IPEX is optional.
        if importlib.util.find_spec(IPEX_MODULE) is not None:
            importlib.import_module(IPEX_MODULE)
        importlib.import_module(BINDINGS_MODULE)

    def package_versions(self) -> dict[str, str]:
        """Versions of the Intel packages, read from metadata so nothing is imported."""
        out = {}
        for dist_name in ("intel_extension_for_pytorch", "oneccl_bind_pt"):
            try:
                out[dist_name] = importlib.metadata.version(dist_name)
            except importlib.metadata.PackageNotFoundError:
                pass
        return out
