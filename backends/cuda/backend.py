"""The CUDA backend: NCCL collectives, torch.cuda streams and events, caching-allocator stats."""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
from typing_extensions import override

from shardkit import Backend, Capabilities
from shardkit.backend import check_reduce_op
from shardkit.handles import Group
from shardkit.install_hint import pip_install_extra
from shardkit.launch_env import LaunchEnv

from .policy import bf16_ready, bind_device_id, exact_reduce_ops, sdpa_runs_fused


class CUDABackend(Backend):
    """NVIDIA GPUs through torch.cuda and NCCL."""

    name = "cuda"
    device_type = "cuda"
    priority = 30
    collective_libraries = ("nccl",)
    # NCCL >= 2.10 averages in the collective itself; exact_reduce_ops_for narrows per version
    # and dtype (policy.exact_reduce_ops).
    capabilities = Capabilities(has_streams=True, async_collectives=True,
                                supports_storage_resize=True, shard_alignment=1,
                                exact_reduce_ops=frozenset({"avg", "premul_sum"}),
                                fused_attention=sdpa_runs_fused,
                                # torch's caching allocator: max_memory_reserved was 1.13-1.44 x
                                # max_memory_allocated over 5 models on an H200 (torch 2.11,
                                # issue 34); planned to the worst of them until measured here.
                                allocator_headroom=0.45,
                                # NCCL's work objects keep their tensors until the watchdog
                                # thread retires them.
                                collective_tensors_linger=True,
                                # cuBLAS's workspaces, held from the first matmul on: the H100
                                # run held 64 MiB more than the same step on the host
                                # (benchmarks/README.md, the planner's GPU table).
                                library_workspace_bytes=64 << 20)

    @override
    @classmethod
    def is_available(cls) -> bool:
        """True when torch is a CUDA build, sees a GPU, and has NCCL."""
        import torch.distributed as dist

        return (torch.version.cuda is not None and torch.cuda.is_available()
                and dist.is_available() and dist.is_nccl_available())

    @override
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

    @override
    @classmethod
    def requirement_hint(cls) -> str:
        """A CUDA build of torch on a machine with an NVIDIA GPU and driver."""
        return (f"{pip_install_extra('cuda')} with a CUDA build of torch "
                "(pip install torch --index-url https://download.pytorch.org/whl/cu128) "
                "on a machine with an NVIDIA GPU and driver")

    @override
    @classmethod
    def versions(cls) -> dict[str, str]:
        """CUDA runtime and NCCL versions torch was built with."""
        out = {"torch": torch.__version__, "cuda": str(torch.version.cuda)}
        nccl = _nccl_version()
        if nccl is not None:
            out["nccl"] = ".".join(str(v) for v in nccl)
        return out

    # ---- devices ------------------------------------------------------------------------------
    @override
    def local_device(self, local_rank: int) -> torch.device:
        """One GPU per local rank, wrapping around when ranks outnumber visible GPUs."""
        count = max(torch.cuda.device_count(), 1)
        return torch.device("cuda", local_rank % count)

    @override
    def device_count(self) -> int:
        """Visible GPUs (after CUDA_VISIBLE_DEVICES)."""
        return torch.cuda.device_count()

    @override
    def supports_dtype(self, dtype: torch.dtype) -> bool:
        """bf16 exactly when the T5 tutorial's bf16_ready holds, but counting only native bf16.

        The tutorial calls is_bf16_supported(), which newer torch answers True for emulated bf16
        on pre-Ampere GPUs (slow); shardkit asks for native support (compute capability >= 8.0).
        """
        if dtype == torch.bfloat16:
            return bf16_ready(torch.version.cuda,
                              bool(torch.cuda.is_bf16_supported(including_emulation=False)),
                              _nccl_version())
        return super().supports_dtype(dtype)

    # ---- streams and events through torch.cuda -----------------------------------------------
    @override
    def new_stream(self, device: torch.device) -> Any:
        """A new CUDA stream on `device`."""
        return torch.cuda.Stream(device=device)

    @override
    def new_event(self) -> Any:
        """A CUDA event (no timing, so recording is cheap)."""
        return torch.cuda.Event()

    # ---- process group ------------------------------------------------------------------------
    @override
    def process_group_backend(self) -> str:
        """NCCL for GPU tensors."""
        return "nccl"

    @override
    def fault_tolerant_process_group(self, timeout: datetime.timedelta) -> Any:
        """torchft's NCCL group: it aborts the communicator of a failed quorum instead of hanging in it."""
        from shardkit.fault_tolerance import require_torchft

        require_torchft()
        from torchft.process_group import ProcessGroupNCCL

        return ProcessGroupNCCL(timeout=timeout)

    @override
    def process_group_options(self, env: LaunchEnv) -> dict[str, Any]:
        """Pass device_id where this torch version is safe with it (see policy.bind_device_id)."""
        bind, _why = bind_device_id(torch.__version__, os.environ)
        return {"device_id": self.local_device(env.local_rank)} if bind else {}

    @override
    def barrier(self, group: Group) -> None:
        """Barrier on this process's current GPU, never one NCCL guesses from the rank."""
        import torch.distributed as dist

        # Also right where device_id was not bound, or is ignored under
        # TORCH_DISTRIBUTED_DEBUG=DETAIL's wrapper group (pytorch#178977).
        if group.size > 1:
            dist.barrier(group=group.handle, device_ids=[torch.cuda.current_device()])

    @override
    def exact_reduce_ops_for(self, dtype: torch.dtype) -> frozenset[str]:
        """AVG / PREMUL_SUM where this NCCL computes them exactly for `dtype` (policy.exact_reduce_ops)."""
        ops, _why = exact_reduce_ops(_nccl_version(), dtype)
        return ops & self.capabilities.exact_reduce_ops

    @override
    def torch_reduce_op(self, op: str, factor: float | None = None) -> Any:
        """NCCL's pre-scaled sum for "premul_sum" (torch builds it per call from the factor)."""
        if op == "premul_sum":
            import torch.distributed as dist

            check_reduce_op(self, op, factor)  # raises unless a factor was given
            assert factor is not None
            return dist._make_nccl_premul_sum(factor)
        return super().torch_reduce_op(op, factor)

    @override
    def ddp_kwargs(self, device: torch.device) -> dict[str, Any]:
        """DDP on a GPU needs its device id."""
        return {"device_ids": [device.index], "output_device": device.index}


def _nccl_version() -> tuple[int, ...] | None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_nccl_available()):
        return None
    try:
        return tuple(torch.cuda.nccl.version())
    except Exception:  # noqa: BLE001 - a CUDA build without a usable libnccl
        return None
