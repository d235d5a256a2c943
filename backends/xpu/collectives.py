"""Which torch.distributed backend an XPU job uses: native xccl, or the legacy oneCCL "ccl"."""

from __future__ import annotations

import os
import warnings

from shardkit.errors import BackendUnavailableError, ShardkitError

from .runtime import INTEL_INDEX, TORCH_XPU_INDEX

ENV_VAR = "SHARDKIT_XPU_PG"
CHOICES = ("auto", "xccl", "ccl")

XCCL_HINT = (f"install torch >= 2.8 from the XPU index, which ships xccl: "
             f"pip install torch --index-url {TORCH_XPU_INDEX}")
CCL_HINT = ("install the legacy oneCCL bindings from Intel's index (not on PyPI), with versions "
            "matching your torch, e.g. for torch 2.7: pip install intel-extension-for-pytorch==2.7.10+xpu "
            f"oneccl_bind_pt==2.7.0+xpu --extra-index-url {INTEL_INDEX}")


def requested_process_group(explicit: str | None = None) -> str:
    """Return what the user asked for: the constructor option, else SHARDKIT_XPU_PG, else "auto"."""
    source = "process_group=" if explicit is not None else f"{ENV_VAR}="
    value = explicit if explicit is not None else os.environ.get(ENV_VAR, "")
    value = value.strip().lower() or "auto"
    if value not in CHOICES:
        raise ShardkitError(f"{source}{value!r} is not a known XPU process-group backend; use one "
                            f"of {', '.join(CHOICES)} (auto: xccl when torch has it, else ccl)")
    return value


def choose_process_group(requested: str, xccl_available: bool, ccl_installed: bool) -> str:
    """Return "xccl" or "ccl" for the request and what is installed, or raise saying what to install."""
    if requested == "xccl":
        if not xccl_available:
            raise BackendUnavailableError(
                f"{ENV_VAR}=xccl was requested but this torch has no xccl backend.\nHINT: {XCCL_HINT}"
                f"\nor use the legacy bindings with {ENV_VAR}=ccl")
        return "xccl"
    if requested == "ccl":
        if not ccl_installed:
            raise BackendUnavailableError(
                f"{ENV_VAR}=ccl was requested but oneccl_bindings_for_pytorch is not installed.\n"
                f"HINT: {CCL_HINT}")
        _warn_legacy("it was requested")
        return "ccl"
    if xccl_available:
        return "xccl"
    if ccl_installed:
        _warn_legacy("this torch has no xccl")
        return "ccl"
    raise BackendUnavailableError(
        "the xpu backend has no collective library: this torch has no xccl backend and "
        f"oneccl_bindings_for_pytorch is not installed.\nHINT: {XCCL_HINT} (recommended), or {CCL_HINT}")


def _warn_legacy(why: str) -> None:
    warnings.warn(f"shardkit xpu: using the legacy oneCCL 'ccl' process group because {why}; "
                  "Intel has archived intel_extension_for_pytorch and deprecated the oneCCL "
                  f"bindings. {XCCL_HINT} to use the native xccl backend.", FutureWarning,
                  stacklevel=3)
