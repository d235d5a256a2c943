"""The CPU kernels' workspace rule (Capabilities.kernel_workspace) against measured scratch."""

from __future__ import annotations

import pytest
import torch

import shardkit
from shardkit.kernel_workspace import KernelCall, cpu_kernel_workspace

from _planner_act_workers import allocation_peak

# (batch, in channels, image side, out channels, kernel, stride): ViT patch embeddings of
# several sizes and 3 x 3 convolutions of a ResNet's middle.
SHAPES = [(2, 3, 224, 256, 16, 16), (4, 3, 224, 256, 16, 16), (2, 3, 224, 512, 16, 16),
          (2, 3, 448, 256, 16, 16), (2, 3, 224, 256, 32, 32), (2, 64, 56, 64, 3, 1),
          (8, 3, 224, 768, 16, 16), (2, 3, 224, 768, 14, 14), (1, 3, 224, 1024, 16, 16),
          (4, 128, 28, 128, 3, 1)]


def _measured_scratch(shape, dtype, input_grad):
    """What convolution_backward allocated beyond the gradients it returned."""
    batch, cin, side, cout, kernel, stride = shape
    x = torch.randn(batch, cin, side, side, dtype=dtype, requires_grad=input_grad)
    w = torch.randn(cout, cin, kernel, kernel, dtype=dtype, requires_grad=True)
    y = torch.nn.functional.conv2d(x, w, stride=stride)
    grad_y = torch.ones_like(y)
    wanted = (x, w) if input_grad else (w,)
    returned = sum(t.numel() * t.element_size() for t in wanted)
    peak = allocation_peak(lambda: torch.autograd.grad(y, wanted, grad_y, retain_graph=True))
    call = KernelCall("aten.convolution_backward.default",
                      (tuple(grad_y.shape), tuple(x.shape), tuple(w.shape)),
                      (dtype, dtype, dtype), torch.get_num_threads())
    return peak - returned, cpu_kernel_workspace(call)


def _check(threads, dtype, input_grad):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for shape in SHAPES:
            measured, rule = _measured_scratch(shape, dtype, input_grad)
            print(f"{dtype} threads {threads} input grad {input_grad} {shape}: measured "
                  f"{measured / 2**20:.2f} MiB, rule {rule / 2**20:.2f} MiB")
            assert measured <= rule, shape
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("input_grad", [False, True], ids=["weight-only", "input-too"])
def test_the_rule_covers_a_convolutions_scratch_at_one_thread(dtype, input_grad):
    _check(1, dtype, input_grad)


@pytest.mark.long
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_rule_covers_a_convolutions_scratch_at_two_threads(dtype):
    _check(2, dtype, False)


def test_the_rule_is_silent_for_other_ops_and_the_plan_follows_the_threads():
    call = KernelCall("aten.mm.default", ((4, 4), (4, 4)), (torch.float32,) * 2, 8)
    assert cpu_kernel_workspace(call) == 0

    class Patches(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 64, 16, stride=16)
            self.head = torch.nn.Linear(64, 10)

        def forward(self, x):
            return self.head(self.conv(x).mean((2, 3)))

    with torch.device("meta"):
        model = Patches()
    inputs = lambda batch, side: ((torch.zeros(batch, 3, side, side, device="meta"),), {})  # noqa: E731
    one, four = (shardkit.plan(model, world_size=2, batch=4, seq=64, example_inputs=inputs,
                               backend="cpu", threads_per_rank=t) for t in (1, 4))
    # fp32 splits the batch (4) over up to 4 threads: the scratch at that op is 4 x one thread's.
    weight, sample, output = 64 * 3 * 16 * 16 * 4, 3 * 64 * 64 * 4, 4 * 64 * 4 * 4 * 4
    per_thread = 5 * weight + 3 * sample + output // 2 + 2 * 2**20
    assert four.peak_bytes - one.peak_bytes >= 3 * per_thread * 0.99
