"""`shardkit.replicate` is DDP done right for the backend: parity with unsharded training, and its options."""

from __future__ import annotations

import pytest
import torch

import shardkit
from shardkit.replicate import replicate
from shardkit_backends.cpu import CPUBackend
from shardkit_backends.cuda import CUDABackend

WORLD = 2
STEPS = 4
PER_RANK = 6
OPTIMIZERS = ("sgd", "adamw")


def make_model() -> torch.nn.Module:
    """A small MLP with the same initial weights wherever it is built."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    """The optimizers the parity test covers."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The whole job's data: one concatenated batch per step (rank r owns rows r*PER_RANK...)."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(WORLD * PER_RANK, 8, generator=g), torch.randn(WORLD * PER_RANK, 3, generator=g))
            for _ in range(STEPS)]


def train_replicated(rank: int, opt_names, data):
    """One rank of DDP-through-replicate training on its slice of every batch (a spawn target)."""
    ctx = shardkit.current_context()
    out = {}
    for opt_name in opt_names:
        model = replicate(make_model())
        opt = make_optimizer(opt_name, model.parameters())
        for x, y in data:
            per_rank = len(x) // ctx.world_size
            rows = slice(rank * per_rank, (rank + 1) * per_rank)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x[rows].to(ctx.device)), y[rows].to(ctx.device))
            loss.backward()
            opt.step()
        out[opt_name] = {k: v.detach().cpu() for k, v in model.module.state_dict().items()}
    return {"states": out, "device_ids": model.device_ids, "device": str(ctx.device)}


def train_unsharded(opt_name: str, data, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The reference: one process, one model, the concatenated batch."""
    model = make_model().to(device)
    opt = make_optimizer(opt_name, model.parameters())
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference over every entry of two state dicts."""
    return max((a[k] - b[k]).abs().max().item() for k in b)


@pytest.mark.slow
def test_ddp_through_replicate_matches_unsharded_training():
    data = batches()
    results = shardkit.spawn(train_replicated, WORLD, OPTIMIZERS, data, backend="cpu",
                             threads_per_rank=1)
    start = make_model().state_dict()
    for opt_name in OPTIMIZERS:
        reference = train_unsharded(opt_name, data)
        assert max_diff(reference, start) > 1e-3  # training moved the weights: agreement means something
        for res in results:
            assert res["device_ids"] is None  # DDP on CPU takes no device_ids
            diff = max_diff(res["states"][opt_name], reference)
            assert diff <= 1e-5, f"{opt_name}: max abs diff {diff}"


class BucketViewCPU(CPUBackend):
    """The CPU backend asking DDP for what XLA asks for (a stand-in for a backend with DDP options)."""

    name = "cpu-bucket-view"

    def ddp_kwargs(self, device):
        """XLA-style options."""
        return {"gradient_as_bucket_view": True, "bucket_cap_mb": 1}


def test_backend_ddp_options_are_applied_and_caller_options_win():
    shardkit.init(BucketViewCPU())
    try:
        ddp = replicate(make_model())
        assert ddp.gradient_as_bucket_view is True
        assert ddp.bucket_bytes_cap == 1024 * 1024
        assert ddp.process_group is shardkit.current_context().world.handle
        ddp = replicate(make_model(), gradient_as_bucket_view=False)
        assert ddp.gradient_as_bucket_view is False and ddp.bucket_bytes_cap == 1024 * 1024
    finally:
        shardkit.shutdown()


def test_replicate_refuses_a_different_backend_than_the_initialised_one():
    shardkit.init("cpu")
    try:
        with pytest.raises(shardkit.ShardkitError):
            replicate(make_model(), backend=BucketViewCPU())
    finally:
        shardkit.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDABackend.is_available(), reason="needs a CUDA GPU, a CUDA build of "
                    "torch and NCCL (run: pytest -m gpu tests/test_replicate.py)")
def test_replicate_on_cuda_world_one_matches_unsharded():
    data = batches()
    res = shardkit.spawn(train_replicated, 1, OPTIMIZERS, data, backend="cuda")[0]
    assert res["device_ids"] == [0] and res["device"] == "cuda:0"
    for opt_name in OPTIMIZERS:
        diff = max_diff(res["states"][opt_name], train_unsharded(opt_name, data, "cuda"))
        assert diff <= 1e-5, f"{opt_name}: max abs diff {diff}"
