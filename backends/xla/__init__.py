"""The XLA backend plugin (``shardkit[xla]``): PJRT devices (TPU, or CPU with PJRT_DEVICE=CPU)."""

from shardkit import hookimpl

from . import threads
from .backend import XLABackend

__all__ = ["XLABackend"]


@hookimpl
def shardkit_register_backends(registry):
    """Register the XLA backend (chosen automatically only when PJRT_DEVICE is set)."""
    registry.add(XLABackend)


@hookimpl
def shardkit_reset_state():
    """Drop the barriers that the device threads of earlier runs shared."""
    threads.reset_barriers()
