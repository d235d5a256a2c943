"""Decisions the CUDA backend takes from version numbers and call shapes: device_id binding, bf16
readiness, which averaging reduce ops are exact, and which attention kernel a call gets.

Pure functions of their inputs, so every branch is tested on machines without a GPU.
"""

from __future__ import annotations

import re
from typing import Mapping

import torch

from shardkit.capabilities import AttentionCall
from shardkit.errors import ShardkitError

OVERRIDE_ENV = "SHARDKIT_NCCL_DEVICE_ID"


def version_tuple(version: str | None) -> tuple[int, ...]:
    """Turn "2.9.0+cu128" or "12.4" into (2, 9, 0) / (12, 4); None or junk into ()."""
    if not version:
        return ()
    match = re.match(r"\d+(\.\d+)*", str(version))
    return tuple(int(p) for p in match.group(0).split(".")) if match else ()


def _truthy(value: str | None) -> bool | None:
    if value is None or not value.strip():
        return None
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    return None


def bind_device_id(torch_version: str, environ: Mapping[str, str]) -> tuple[bool, str]:
    """Return (pass device_id to init_process_group?, why) for this torch version and environment.

    Passing it binds the group to this rank's GPU: NCCL then connects eagerly, splits subgroups
    from the world communicator, and barrier() uses the right GPU instead of guessing
    rank % ngpus (the "Guessing device ID based on global rank" hangs, pytorch#142356).
    It must be left out where eager init turns on NCCL's non-blocking API, which hangs at random
    with NCCL 2.26 (pytorch#153960): torch 2.7.0 does that by default (2.7.1 reverted it,
    pytorch PR #154055), and TORCH_NCCL_USE_COMM_NONBLOCKING=1 does it on any version.
    SHARDKIT_NCCL_DEVICE_ID=0/1 overrides the policy.
    """
    override = environ.get(OVERRIDE_ENV)
    if override is not None and override.strip():
        forced = _truthy(override)
        if forced is None:
            raise ShardkitError(f"{OVERRIDE_ENV}={override!r} must be 0 or 1 (or unset for the "
                                "per-version policy)")
        return forced, f"{OVERRIDE_ENV}={override}"
    version = version_tuple(torch_version)[:3]
    if version < (2, 3):
        return False, f"torch {torch_version} has no device_id argument (added in 2.3)"
    if version == (2, 7, 0):
        return False, ("torch 2.7.0 turns on NCCL's non-blocking init with device_id, which hangs "
                       "at random (pytorch#153960)")
    if _truthy(environ.get("TORCH_NCCL_USE_COMM_NONBLOCKING")):
        return False, ("TORCH_NCCL_USE_COMM_NONBLOCKING=1 with eager init hangs at random "
                       "(pytorch#153960)")
    return True, "binds barrier and subgroups to this rank's GPU (pytorch#142356)"


def bf16_ready(cuda_version: str | None, native_bf16: bool,
               nccl_version: tuple[int, ...] | None) -> bool:
    """The T5 FSDP tutorial's bf16_ready: CUDA >= 11, native bf16 on the GPU, NCCL >= 2.10."""
    return (bool(cuda_version) and native_bf16 and version_tuple(cuda_version) >= (11, 0)
            and nccl_version is not None and tuple(nccl_version) >= (2, 10))


def exact_reduce_ops(nccl_version: tuple[int, ...] | None,
                     dtype: torch.dtype) -> tuple[frozenset[str], str]:
    """Return (the averaging ops NCCL computes exactly for `dtype`, why).

    ncclAvg and the pre-scaled sum (ncclRedOpCreatePreMulSum, torch's PREMUL_SUM) arrived in
    NCCL 2.10. bf16 PREMUL_SUM is left out: torch hands NCCL a host factor stored as a 4-byte
    float where NCCL reads 2 bytes, so every power-of-two factor (1/2, 1/4, ...) arrives as zero
    and the reduction silently returns zeros (pytorch#190745; the fix, pytorch PR #190747, is in
    no release known here). AVG computes its own factor inside NCCL and is not affected.
    """
    if nccl_version is None or tuple(nccl_version) < (2, 10):
        return frozenset(), f"NCCL {_dotted(nccl_version)} has no AVG / PREMUL_SUM (added in 2.10)"
    if dtype == torch.bfloat16:
        return frozenset({"avg"}), ("bf16 PREMUL_SUM reads its factor as zero for powers of two "
                                    "(pytorch#190745)")
    return frozenset({"avg", "premul_sum"}), f"NCCL {_dotted(nccl_version)} >= 2.10"


def _dotted(version: tuple[int, ...] | None) -> str:
    return "unknown" if version is None else ".".join(str(v) for v in version)


HALF_DTYPES = (torch.float16, torch.bfloat16)


def sdpa_runs_fused(call: AttentionCall) -> bool:
    """Whether torch's CUDA scaled_dot_product_attention takes a fused kernel for `call`.

    Flash attention takes fp16/bf16 without a mask, head_dim <= 256, with dropout and grouped
    key/value heads; memory-efficient attention takes any float dtype, masks (their gradient
    too) and dropout, but not grouped heads. Anything else runs the math path, which keeps the
    (seq x seq) scores. Seen on an H100 (torch 2.11): fp32 GPT-2 with attention dropout ran the
    efficient kernel, fp32 Llama with grouped heads (enable_gqa) the math path.
    """
    flash = call.dtype in HALF_DTYPES and not call.masked and call.head_dim <= 256
    efficient = not call.grouped_query
    return flash or efficient
