"""plan(batch=, seq=)'s peak against the CUDA allocator's max_memory_allocated (needs a GPU)."""

from __future__ import annotations

import pytest
import torch

import shardkit
from shardkit.wrap import transformer_layers

pytest.importorskip("transformers")

from _planner_act_workers import build, measured_device_peak

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("name, batch, seq, ac", [
    ("gpt2-small", 8, 512, False), ("gpt2-small", 8, 512, True),
    ("llama-tiny", 4, 1024, False), ("llama-tiny", 4, 1024, True)])
def test_predicted_peak_matches_the_cuda_allocator(name, batch, seq, ac):
    (got,) = shardkit.spawn(measured_device_peak, 1, name, batch, seq, ac, backend="cuda",
                            threads_per_rank=1)
    make, block = build(name)
    with torch.device("meta"):
        model = make()
    plan = shardkit.plan(model, world_size=1, auto_wrap_policy=transformer_layers({block}),
                         optimizer="adamw", batch=batch, seq=seq, activation_checkpointing=ac,
                         backend="cuda")
    print(f"{name} batch {batch} seq {seq} ac {ac}: predicted {plan.peak_bytes / 2**20:.1f} MiB, "
          f"max_memory_allocated {got['peak'] / 2**20:.1f} MiB (held when the step began "
          f"{got['held_before'] / 2**20:.1f})")
    assert plan.peak_bytes == pytest.approx(got["peak"], rel=0.05)  # issue 22's bound
    # "What fits" keeps the declared allocator headroom free: it must cover what was reserved.
    headroom = shardkit.get_backend("cuda").capabilities.allocator_headroom
    print(f"  max_memory_reserved {got['reserved'] / 2**20:.1f} MiB = "
          f"{got['reserved'] / got['peak']:.3f} x allocated (declared headroom {headroom:.2f})")
    assert got["reserved"] <= (1 + headroom) * got["peak"]
