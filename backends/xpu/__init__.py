"""The Intel XPU backend plugin (``shardkit[xpu]``): native xccl, or the legacy oneCCL bindings."""

from shardkit import hookimpl

from .backend import XPUBackend

__all__ = ["XPUBackend"]


@hookimpl
def shardkit_register_backends(registry):
    """Register the XPU backend (it touches no device until asked)."""
    registry.add(XPUBackend)
