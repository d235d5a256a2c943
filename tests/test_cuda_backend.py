"""The CUDA backend: its decisions everywhere (monkeypatched), and the real thing on a GPU.

Run the GPU part with `pytest -m gpu tests/test_cuda_backend.py`; without a GPU it skips.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardkit
from shardkit.capabilities import AttentionCall
from shardkit.errors import ShardkitError
from shardkit.handles import Group
from shardkit.launch_env import LaunchEnv
from shardkit.testing import CHECK_NAMES, run_world
from shardkit_backends.cuda import CUDABackend
from shardkit_backends.cuda.policy import (bf16_ready, bind_device_id, exact_reduce_ops, sdpa_runs_fused,
                                            version_tuple)

HAS_GPU = CUDABackend.is_available()
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU, a CUDA build of torch and "
                               "NCCL (run: pytest -m gpu tests/test_cuda_backend.py)")


def env_for(local_rank: int) -> LaunchEnv:
    """A LaunchEnv of an 8-rank job on this node."""
    return LaunchEnv(local_rank, 8, local_rank, 8, "127.0.0.1", 29500, "torchrun")


# ---- decisions, on every machine ----------------------------------------------------------------
def test_registered_through_the_plugin_registry():
    from shardkit.plugin.manager import plugin_state

    assert plugin_state().registry.get("cuda") is CUDABackend


@pytest.mark.skipif(HAS_GPU, reason="a GPU is present")
def test_unavailable_here_says_why():
    assert not CUDABackend.is_available()
    reason = CUDABackend.unavailable_reason()
    assert "not a CUDA build" in reason or "sees no GPU" in reason or "no NCCL" in reason
    assert "download.pytorch.org/whl/cu" in CUDABackend.requirement_hint()


@pytest.mark.parametrize("version, expected", [
    ("2.9.0+cu128", (2, 9, 0)), ("12.4", (12, 4)), ("2.10.0a0+git1234", (2, 10, 0)),
    (None, ()), ("", ()), ("junk", ()),
])
def test_version_tuple(version, expected):
    assert version_tuple(version) == expected


@pytest.mark.parametrize("torch_version, environ, bind", [
    ("2.2.2", {}, False),                                   # no device_id argument yet
    ("2.5.1+cu124", {}, True),
    ("2.7.0+cu126", {}, False),                             # non-blocking eager init hangs
    ("2.7.0", {}, False),
    ("2.7.1+cu126", {}, True),                              # 2.7.1 turned non-blocking off
    ("2.9.0+cu128", {}, True),
    ("2.13.0", {}, True),
    ("2.9.0", {"TORCH_NCCL_USE_COMM_NONBLOCKING": "1"}, False),
    ("2.9.0", {"TORCH_NCCL_USE_COMM_NONBLOCKING": "0"}, True),
    ("2.7.0", {"SHARDKIT_NCCL_DEVICE_ID": "1"}, True),      # the user overrides the policy
    ("2.9.0", {"SHARDKIT_NCCL_DEVICE_ID": "0"}, False),
    ("2.9.0", {"SHARDKIT_NCCL_DEVICE_ID": ""}, True),
])
def test_device_id_policy(torch_version, environ, bind):
    decided, why = bind_device_id(torch_version, environ)
    assert decided is bind and why


def test_device_id_policy_names_the_issue_when_it_refuses():
    assert "153960" in bind_device_id("2.7.0", {})[1]
    assert "153960" in bind_device_id("2.9.0", {"TORCH_NCCL_USE_COMM_NONBLOCKING": "true"})[1]
    with pytest.raises(ShardkitError, match="SHARDKIT_NCCL_DEVICE_ID='maybe' must be 0 or 1"):
        bind_device_id("2.9.0", {"SHARDKIT_NCCL_DEVICE_ID": "maybe"})


def test_process_group_options_follow_the_policy(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("SHARDKIT_NCCL_DEVICE_ID", raising=False)
    monkeypatch.delenv("TORCH_NCCL_USE_COMM_NONBLOCKING", raising=False)
    be = CUDABackend()
    monkeypatch.setattr(torch, "__version__", "2.9.0+cu128")
    assert be.process_group_options(env_for(6)) == {"device_id": torch.device("cuda:2")}
    monkeypatch.setattr(torch, "__version__", "2.7.0+cu126")
    assert be.process_group_options(env_for(6)) == {}
    assert be.process_group_backend() == "nccl"


@pytest.mark.parametrize("cuda, native, nccl, ready", [
    ("12.8", True, (2, 26, 2), True),
    ("11.0", True, (2, 10, 3), True),
    ("10.2", True, (2, 10, 3), False),   # CUDA too old
    ("12.8", False, (2, 26, 2), False),  # pre-Ampere: bf16 only emulated
    ("12.8", True, (2, 9, 9), False),    # NCCL without bf16 reductions
    ("12.8", True, None, False),         # no NCCL at all
    (None, True, (2, 26, 2), False),     # not a CUDA build
])
def test_bf16_ready_is_the_t5_tutorial_expression(cuda, native, nccl, ready):
    assert bf16_ready(cuda, native, nccl) is ready


F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize("call, fused", [
    # Seen on an H100 (torch 2.11): fp32 GPT-2 with attention dropout ran the efficient kernel,
    # fp32 Llama with grouped key/value heads the math path.
    (AttentionCall(F32, dropout=True), True),
    (AttentionCall(F32, grouped_query=True), False),
    (AttentionCall(BF16, grouped_query=True, dropout=True), True),  # flash shares the heads
    (AttentionCall(BF16, grouped_query=True, masked=True), False),  # flash takes no mask
    (AttentionCall(BF16, grouped_query=True, head_dim=320), False),
    (AttentionCall(F32, masked=True, mask_needs_grad=True), True),  # efficient's bias gradient
    (AttentionCall(BF16), True),
])
def test_cuda_attention_kernel_choice(call, fused):
    assert sdpa_runs_fused(call) is fused
    assert CUDABackend().runs_fused_attention(call) is fused


def test_supports_dtype_bf16_asks_for_native_support(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 26, 2))
    be = CUDABackend()
    # An Ampere-or-newer GPU has bf16 natively.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert be.supports_dtype(torch.bfloat16) is True
    # A pre-Ampere GPU only emulates it: torch says yes unless asked for native support.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: including_emulation)
    assert be.supports_dtype(torch.bfloat16) is False
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 8, 0))
    assert be.supports_dtype(torch.bfloat16) is False
    assert be.supports_dtype(torch.float32) and not be.supports_dtype(torch.int32)


def test_device_normalisation(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    be = CUDABackend()
    assert be.normalize_device(None, 1) == torch.device("cuda:1")
    assert be.normalize_device("cuda", 3) == torch.device("cuda:1")  # wraps around
    assert be.normalize_device(1, 0) == torch.device("cuda:1")
    with pytest.raises(ShardkitError, match="out of range"):
        be.normalize_device("cuda:2", 0)
    with pytest.raises(ShardkitError, match="'xpu' device but the 'cuda' backend"):
        be.normalize_device("xpu:0", 0)


def test_launcher_env_ddp_kwargs_and_barrier_device(monkeypatch):
    be = CUDABackend()
    assert be.ddp_kwargs(torch.device("cuda:3")) == {"device_ids": [3], "output_device": 3}
    seen = {}
    monkeypatch.setattr(dist, "barrier", lambda **kw: seen.update(kw))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    be.barrier(Group(0, 2, (0, 1), handle="world"))
    assert seen == {"group": "world", "device_ids": [3]}
    seen.clear()
    be.barrier(Group(0, 1, (0,), handle="world"))
    assert seen == {}


# ---- the real thing -------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("check", CHECK_NAMES)
def test_conformance_on_nccl(world_size, check, _cuda_conformance):
    result = _cuda_conformance(world_size)
    if result.skipped:
        pytest.skip(result.skipped)
    assert result.failure(check) is None, result.failure(check)


@pytest.fixture(scope="module")
def _cuda_conformance():
    cache = {}

    def get(world_size):
        if world_size not in cache:
            cache[world_size] = run_world("cuda", world_size)
        return cache[world_size]
    return get


def _real_gpu_facts(rank):
    """Inside a 1-rank NCCL job: binding, dtype, streams/events overlap, storage and memory stats."""
    ctx = shardkit.current_context()
    be, dev = ctx.backend, ctx.device
    out = {"device": str(dev), "pg": dist.get_backend(),
           "bound": str(getattr(dist.group.WORLD, "bound_device_id", None))}
    nccl = torch.cuda.nccl.version()
    out["bf16_by_hand"] = bool(torch.version.cuda and torch.cuda.is_bf16_supported()
                               and version_tuple(torch.version.cuda) >= (11, 0)
                               and dist.is_nccl_available() and tuple(nccl) >= (2, 10))
    out["bf16"] = be.supports_dtype(torch.bfloat16)
    # A side stream computes while the main stream waits on an event: the result must be there.
    main, side, done = be.current_stream(dev), be.new_stream(dev), be.new_event()
    x = torch.randn(1024, 1024, device=dev)
    side.wait_stream(main)
    with be.use_stream(side):
        y = x @ x
        done.record(side)
    be.record_stream(y, main)
    main.wait_event(done)
    out["stream_result_ok"] = bool(torch.allclose(y, x @ x, rtol=1e-4, atol=1e-3))
    out["side_is_not_main"] = side != main
    # free/alloc storage moves the caching allocator's count by the tensor's bytes.
    be.synchronize(dev)
    t = torch.empty(1 << 20, device=dev)
    before = be.memory_stats(dev)["allocated"]
    be.free_storage(t)
    after_free = be.memory_stats(dev)["allocated"]
    be.alloc_storage(t)
    out["freed_bytes"] = before - after_free
    out["realloc_bytes"] = be.memory_stats(dev)["allocated"] - after_free
    out["peak_ge_alloc"] = be.memory_stats(dev)["peak"] >= be.memory_stats(dev)["allocated"]
    be.barrier(ctx.world)
    return out


@pytest.mark.gpu
@needs_gpu
def test_real_gpu_nccl_world_one_streams_memory_and_bf16():
    facts = shardkit.spawn(_real_gpu_facts, 1, backend="cuda")[0]
    assert facts["device"] == "cuda:0" and facts["pg"] == "nccl"
    if bind_device_id(torch.__version__, {})[0]:
        assert facts["bound"] == "cuda:0"
    assert facts["bf16"] == facts["bf16_by_hand"]
    assert facts["stream_result_ok"] and facts["side_is_not_main"]
    assert facts["freed_bytes"] == 4 << 20 and facts["realloc_bytes"] == 4 << 20
    assert facts["peak_ge_alloc"]


# ---- exact reduce ops (AVG / PREMUL_SUM), decided from the NCCL version ------------------------
@pytest.mark.parametrize("nccl, dtype, ops", [
    (None, torch.float32, set()),                                # no NCCL
    ((2, 9, 9), torch.float32, set()),                           # AVG / PREMUL_SUM came in 2.10
    ((2, 10, 3), torch.float32, {"avg", "premul_sum"}),
    ((2, 26, 2), torch.float16, {"avg", "premul_sum"}),
    ((2, 26, 2), torch.float64, {"avg", "premul_sum"}),
    ((2, 26, 2), torch.bfloat16, {"avg"}),                       # bf16 PREMUL_SUM zeroes
    ((2, 9, 9), torch.bfloat16, set()),
])
def test_exact_reduce_ops_policy(nccl, dtype, ops):
    got, why = exact_reduce_ops(nccl, dtype)
    assert got == ops and why
    if dtype == torch.bfloat16 and nccl and nccl >= (2, 10):
        assert "190745" in why


def test_cuda_declares_avg_and_premul_sum_and_narrows_per_dtype(monkeypatch):
    assert CUDABackend.capabilities.exact_reduce_ops == {"avg", "premul_sum"}
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 26, 2))
    be = CUDABackend()
    assert be.exact_reduce_ops_for(torch.float32) == {"avg", "premul_sum"}
    assert be.exact_reduce_ops_for(torch.bfloat16) == {"avg"}
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 8, 4))
    assert be.exact_reduce_ops_for(torch.float32) == set()


def test_cuda_builds_premul_sum_through_torch_nccl(monkeypatch):
    made = []
    monkeypatch.setattr(dist, "_make_nccl_premul_sum", lambda factor: made.append(factor) or "op")
    be = CUDABackend()
    assert be.torch_reduce_op("premul_sum", 0.25) == "op" and made == [0.25]
    assert be.torch_reduce_op("avg") is dist.ReduceOp.AVG
    with pytest.raises(ShardkitError, match="needs a factor"):
        be.torch_reduce_op("premul_sum")
