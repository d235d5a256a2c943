"""The XLA backend plugin (``shardkit[xla]``): PJRT devices (TPU, or CPU with PJRT_DEVICE=CPU)."""

from shardkit import hookimpl

from .backend import XLABackend

__all__ = ["XLABackend"]


@hookimpl
def shardkit_register_backends(registry):
    """Register the XLA backend (chosen automatically only when PJRT_DEVICE is set)."""
    registry.add(XLABackend)
