"""The Intel XPU backend: torch.xpu devices, streams and events; xccl (or legacy oneCCL) collectives."""

from __future__ import annotations

import datetime
from typing import Any

import torch
from typing_extensions import override

from shardkit import Backend, Capabilities
from shardkit.launch_env import LaunchEnv
from shardkit.errors import UnsupportedOperationError
from shardkit.install_hint import pip_install_extra

from .collectives import choose_process_group, requested_process_group
from .runtime import TORCH_XPU_INDEX, XpuRuntime


class XPUBackend(Backend):
    """Intel GPUs through stock torch.xpu; collectives through xccl, or oneCCL's "ccl" on request.

    Pick the collective library with ``XPUBackend(process_group="ccl")`` or
    ``SHARDKIT_XPU_PG=ccl|xccl|auto`` (default auto: xccl when torch has it, else the legacy
    bindings when they are installed).
    """

    name = "xpu"
    device_type = "xpu"
    priority = 20
    # No exact_reduce_ops: oneCCL lacks AVG for reduce and for scale-out all-reduce
    # (uxlfoundation/oneCCL#195), and xccl's PREMUL_SUM needs a workaround across nodes
    # (intel/torch-xpu-ops#2903); the engine sums and divides.
    # torch.xpu's allocator caches blocks as CUDA's does (not measured on XPU hardware): the same
    # allocator headroom as the cuda backend's.
    capabilities = Capabilities(has_streams=True, async_collectives=True,
                                supports_storage_resize=True, shard_alignment=1,
                                collective_tensors_linger=True,  # torch's process-group works
                                allocator_headroom=0.45)
    # Everything learnt about the machine comes from here; tests put a stand-in in its place.
    runtime: XpuRuntime = XpuRuntime()

    def __init__(self, process_group: str | None = None, runtime: XpuRuntime | None = None) -> None:
        self._requested = requested_process_group(process_group) if process_group else None
        self._chosen: dict[str, str] = {}  # request -> library, so the bindings load and warn once
        if runtime is not None:
            self.runtime = runtime

    @override
    @classmethod
    def is_available(cls) -> bool:
        """True when torch sees an XPU (the collective library is checked, loudly, at init)."""
        module = cls.runtime.device_module()
        return module is not None and bool(module.is_available())

    @override
    @classmethod
    def unavailable_reason(cls) -> str:
        """Say whether torch lacks XPU support or sees no device."""
        if cls.runtime.device_module() is None:
            return f"torch {torch.__version__} has no torch.xpu module"
        return (f"torch {torch.__version__} sees no Intel XPU device (not an XPU build of torch, "
                "no Intel GPU driver, or ZE_AFFINITY_MASK hides every device)")

    @override
    @classmethod
    def requirement_hint(cls) -> str:
        """torch's XPU wheels carry both torch.xpu and xccl."""
        return (f"{pip_install_extra('xpu')} with torch's XPU build (pip install torch "
                f"--index-url {TORCH_XPU_INDEX}) on a machine with an Intel GPU and driver")

    @override
    @classmethod
    def versions(cls) -> dict[str, str]:
        """torch, whether it has xccl, and the legacy Intel packages if installed."""
        out = {"torch": torch.__version__, "xccl": str(cls.runtime.xccl_available())}
        out.update(cls.runtime.package_versions())
        return out

    # ---- devices ------------------------------------------------------------------------------
    @override
    def device_module(self) -> Any:
        """torch.xpu, or the stand-in module the tests inject through `runtime`."""
        return self.runtime.device_module()

    @override
    def local_device(self, local_rank: int) -> torch.device:
        """Always an indexed device, so FSDP-style code never falls back to the CUDA default."""
        count = max(self.device_count(), 1)
        return torch.device("xpu", local_rank % count)

    @override
    def device_count(self) -> int:
        """XPUs this process sees (after ZE_AFFINITY_MASK)."""
        return int(self.device_module().device_count())

    @override
    def supports_dtype(self, dtype: torch.dtype) -> bool:
        """bf16 as torch.xpu reports it; float64 only where the GPU has native fp64 (not Arc A-series)."""
        module = self.device_module()
        if dtype == torch.bfloat16:
            probe = getattr(module, "is_bf16_supported", None)
            return bool(probe()) if probe is not None else True
        if dtype == torch.float64:
            props = module.get_device_properties(module.current_device())
            return bool(getattr(props, "has_fp64", True))
        return super().supports_dtype(dtype)

    # ---- streams and events through torch.xpu ------------------------------------------------
    @override
    def new_stream(self, device: torch.device) -> Any:
        """A new torch.xpu stream on `device`."""
        return self.device_module().Stream(device=device)

    @override
    def new_event(self) -> Any:
        """A torch.xpu event."""
        return self.device_module().Event()

    # ---- process group ------------------------------------------------------------------------
    @override
    def process_group_backend(self) -> str:
        """xccl, or ccl (importing the bindings so torch knows the name); raises with a hint if neither."""
        requested = self._requested or requested_process_group()
        if requested not in self._chosen:
            chosen = choose_process_group(requested, self.runtime.xccl_available(),
                                          self.runtime.ccl_installed())
            if chosen == "ccl":
                self.runtime.load_ccl()
            self._chosen[requested] = chosen
        return self._chosen[requested]

    @override
    def fault_tolerant_process_group(self, timeout: datetime.timedelta) -> Any:
        """torchft's xccl group; the legacy oneCCL bindings (ccl) have none, so that case is refused."""
        if self.process_group_backend() != "xccl":
            raise UnsupportedOperationError(
                "fault tolerance across replica groups needs torch's native xccl: torchft has no "
                "process group for oneCCL's legacy 'ccl' bindings. HINT: install torch's XPU "
                "wheel (which ships xccl) and leave SHARDKIT_XPU_PG unset (or set it to xccl)")
        from shardkit.fault_tolerance import require_torchft

        require_torchft()
        from torchft.process_group import ProcessGroupXCCL

        return ProcessGroupXCCL(timeout=timeout)

    @override
    def process_group_options(self, env: LaunchEnv) -> dict[str, Any]:
        """Bind xccl to this rank's XPU; leave the legacy ccl group unbound.

        Without device_id, ProcessGroupXCCL guesses a barrier's device as rank % device count,
        which is wrong whenever ranks and devices are not laid out that way (the NCCL
        "guessing device ID" hang, pytorch#142356). The legacy bindings predate device binding,
        so they get only the current device that shardkit.init() set before this call.
        """
        if self.process_group_backend() != "xccl":
            return {}
        return {"device_id": self.local_device(env.local_rank)}

    @override
    def ddp_kwargs(self, device: torch.device) -> dict[str, Any]:
        """DDP on an XPU takes the device index, like the oneCCL DDP example's device_ids=[device]."""
        return {"device_ids": [device.index], "output_device": device.index}
