"""The CUDA backend: NCCL collectives, CUDA streams and events, caching-allocator stats."""

from __future__ import annotations

import os
from typing import Any

import torch

from shardkit import Backend, Capabilities, hookimpl
from shardkit.launch_env import LaunchEnv


class CUDABackend(Backend):
    """NVIDIA GPUs through torch.cuda and NCCL."""

    name = "cuda"
    device_type = "cuda"
    priority = 30
    capabilities = Capabilities(has_streams=True, async_collectives=True,
                                supports_storage_resize=True, shard_alignment=1)

    @classmethod
    def is_available(cls) -> bool:
        """True when torch is a CUDA build, sees a GPU, and has NCCL."""
        import torch.distributed as dist

        return (torch.version.cuda is not None and torch.cuda.is_available()
                and dist.is_available() and dist.is_nccl_available())

    @classmethod
    def unavailable_reason(cls) -> str:
        """Say which of build, driver/GPU or NCCL is missing."""
        import torch.distributed as dist

        if torch.version.cuda is None:
            return f"torch {torch.__version__} is not a CUDA build"
        if not torch.cuda.is_available():
            return "torch is a CUDA build but sees no GPU (driver missing or CUDA_VISIBLE_DEVICES empty)"
        if not (dist.is_available() and dist.is_nccl_available()):
            return "this torch build has no NCCL"
        return "unknown"

    @classmethod
    def requirement_hint(cls) -> str:
        """A CUDA build of torch on a machine with an NVIDIA GPU and driver."""
        return ("pip install 'shardkit[cuda]' with a CUDA build of torch "
                "(pip install torch --index-url https://download.pytorch.org/whl/cu128) "
                "on a machine with an NVIDIA GPU and driver")

    @classmethod
    def versions(cls) -> dict[str, str]:
        """CUDA runtime and NCCL versions torch was built with."""
        out = {"cuda": str(torch.version.cuda)}
        try:
            out["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001 - CPU builds have no NCCL
            pass
        return out

    def local_device(self, local_rank: int) -> torch.device:
        """One GPU per local rank, wrapping around when ranks outnumber visible GPUs."""
        count = max(torch.cuda.device_count(), 1)
        return torch.device("cuda", local_rank % count)

    def device_count(self) -> int:
        """Visible GPUs (after CUDA_VISIBLE_DEVICES)."""
        return torch.cuda.device_count()

    def process_group_backend(self) -> str:
        """NCCL for GPU tensors."""
        return "nccl"

    def process_group_options(self, env: LaunchEnv) -> dict[str, Any]:
        """Bind the process group to this rank's GPU.

        Without device_id, NCCL guesses the device from the rank, so barrier() can run on the
        wrong GPU and hang when LOCAL_RANK != RANK % ngpus (pytorch#108208, #91617). With it,
        torch >= 2.3 initialises the communicator eagerly; on 2.3-2.5 that eager path deadlocked
        new_group() with a subset of ranks (pytorch#124427). shardkit requires torch >= 2.9,
        where the eager path is fixed, so device_id is always passed.
        """
        return {"device_id": self.local_device(env.local_rank)}

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        """bf16 needs compute capability 8.0+ and CUDA 11+ (what the T5 tutorial's bf16_ready checks)."""
        if dtype == torch.bfloat16:
            return torch.cuda.is_bf16_supported(including_emulation=False)
        return super().supports_dtype(dtype)

    def visible_devices_env(self) -> str | None:
        """Launchers pin GPUs per process with CUDA_VISIBLE_DEVICES."""
        return "CUDA_VISIBLE_DEVICES"

    def new_event(self) -> Any:
        """A CUDA event (no timing, so recording is cheap)."""
        return torch.cuda.Event()

    def ddp_kwargs(self, device: torch.device) -> dict[str, Any]:
        """DDP on a GPU needs its device id."""
        return {"device_ids": [device.index], "output_device": device.index}


@hookimpl
def shardkit_register_backends(registry):
    """Register the CUDA backend (it probes for a GPU only when asked)."""
    registry.add(CUDABackend)
