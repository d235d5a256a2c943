"""The CUDA backend plugin (``shardkit[cuda]``): NCCL, CUDA streams and events."""

from shardkit import hookimpl

from .backend import CUDABackend

__all__ = ["CUDABackend"]


@hookimpl
def shardkit_register_backends(registry):
    """Register the CUDA backend (it probes for a GPU only when asked)."""
    registry.add(CUDABackend)
