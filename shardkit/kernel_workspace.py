"""Scratch memory a device's kernels take that no tensor shows: a fact each backend declares.

The planner rehearses a step on the meta device, where every tensor an op returns is seen but
not what the op's kernel allocates for itself while it runs (oneDNN's per-thread partial
weight gradients in a CPU convolution's backward, cuDNN's workspaces). Each backend declares a
rule, `Capabilities.kernel_workspace(call) -> bytes`, that the rehearsal adds for the moment of
that op; a rule must err high (the planner's peak is an upper bound).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MiB = 1 << 20


@dataclass(frozen=True)
class KernelCall:
    """One op the rehearsal ran, as a workspace rule sees it."""

    op: str  # torch's overload name, e.g. "aten.convolution_backward.default"
    shapes: tuple[tuple[int, ...], ...]  # of its tensor arguments, in order
    dtypes: tuple[torch.dtype, ...]
    threads: int  # intra-op threads of the rank that runs it


def cpu_kernel_workspace(call: KernelCall) -> int:
    """torch's CPU kernels: a convolution's backward keeps per-thread weight-gradient partials.

    Measured with torch 2.13's CPU build (oneDNN) on 10 shapes (patch embeddings of stride 14,
    16 and 32, 3 x 3 convolutions; batch 1-8; fp32 and bf16; 1 and 2 threads): the scratch grew
    with the weight (about 4 x its fp32 bytes per thread in fp32, 12 x in bf16), with one
    sample's input and the output, and with the threads (fp32 splits them over the batch, bf16
    does not). The rule is above every measured shape, by 2 % (bf16 patch embeddings, one
    thread) to 15 x (an fp32 kernel of 14 whose scratch is small; tests/test_kernel_workspace.py)."""
    if call.op != "aten.convolution_backward.default" or len(call.shapes) < 3:
        return 0
    grad_output, sample, weight = call.shapes[0], call.shapes[1], call.shapes[2]
    weight_bytes = math.prod(weight) * 4
    sample_bytes = math.prod(sample[1:]) * 4
    output_bytes = math.prod(grad_output) * 4
    batch = max(sample[0], 1)
    threads = max(call.threads, 1)
    if call.dtypes[1].itemsize < 4 and _patches(grad_output, sample, weight) and not _wide_simd():
        # Without AVX-512 oneDNN takes another bf16 path for a patch embedding: its scratch is
        # the input in bf16, at most (0.29-2.3 MiB over the 5 patch shapes, 1 and 2 threads, an
        # AVX2 EPYC), where the rule below (measured with AVX-512) is 13-40 MiB: a plan that
        # high fails its 1.10 x bound. Twice that, per thread, and 1 MiB.
        return threads * (batch * sample_bytes + MiB)
    if call.dtypes[1].itemsize < 4:
        return threads * (12 * weight_bytes + 3 * sample_bytes + output_bytes // 2 + 2 * MiB)
    return min(threads, batch) * (5 * weight_bytes + 3 * sample_bytes + output_bytes // 2
                                  + 2 * MiB)


def _patches(grad_output: tuple[int, ...], sample: tuple[int, ...], weight: tuple[int, ...]) -> bool:
    """A convolution whose kernel tiles its input without overlap (a ViT's patch embedding)."""
    if len(weight) != 4 or len(sample) != 4 or len(grad_output) != 4:
        return False
    return (weight[2] > 1 and grad_output[2] * weight[2] <= sample[2]
            and grad_output[3] * weight[3] <= sample[3] and grad_output[2] * (weight[2] + 1) > sample[2])


def _wide_simd() -> bool:
    """True where torch's CPU kernels run AVX-512 (or wider): the host the bf16 rule was measured on."""
    return torch.backends.cpu.get_cpu_capability() not in ("DEFAULT", "NO AVX", "AVX2", "ZVECTOR",
                                                           "VSX", "SVE256")
