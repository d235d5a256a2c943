"""Plan any target from any machine, and refuse plan inputs that would give a wrong answer.

A backend's planning facts (shard alignment, direct collectives, which attention calls run fused)
are static, declared on its class; the planner reads them without starting it, so a laptop plans
a CUDA job. The conformance suite checks that a started backend agrees with what it declares.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardkit
from shardkit.job.selection import backend_class
from shardkit.capabilities import AttentionCall, fused_attention_on_cpu
from shardkit.testing import run_world
from shardkit_backends.cpu import CPUBackend
from shardkit_backends.cuda.policy import sdpa_runs_fused


class DropoutAttention(nn.Module):
    """One attention layer with attention dropout: fused on CUDA, the math path on CPU."""

    def __init__(self, width: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, w))


def _model() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(DropoutAttention(), DropoutAttention())


def _plan(backend: str | None, **kw):
    return shardkit.plan(_model(), world_size=2, batch=4, seq=256,
                         example_inputs=lambda batch, seq: (
                             (torch.empty(batch, seq, 64, device="meta"),), {}),
                         backend=backend, **kw)


def test_a_cuda_job_plans_on_a_machine_without_cuda():
    assert not any(s.name == "cuda" and s.available for s in shardkit.backend_statuses())
    on_cpu, on_cuda = _plan("cpu"), _plan("cuda")
    # The CUDA class's declared facts reach the plan: its libraries' workspace is in the margin
    # (the attention rule's effect is tests/test_planner_activations.py's).
    assert on_cuda.margin_bytes >= backend_class("cuda").capabilities.library_workspace_bytes > 0
    assert on_cpu.margin_bytes < backend_class("cuda").capabilities.library_workspace_bytes
    assert on_cpu.persistent == on_cuda.persistent  # alignment 1 on both


def test_declared_facts_are_what_the_planner_reads():
    from shardkit.job.selection import backend_class

    assert backend_class("cuda").capabilities.fused_attention is sdpa_runs_fused
    assert backend_class("cpu").capabilities.fused_attention is fused_attention_on_cpu
    xla = _plan("xla")  # 128-element alignment: shards padded up, declared by the xla class
    assert backend_class("xla").capabilities.shard_alignment == 128
    assert xla.persistent["params"] > _plan("cpu").persistent["params"]


def test_an_unknown_backend_name_is_refused_with_a_guess():
    with pytest.raises(shardkit.BackendNotFoundError, match="did you mean 'cuda'"):
        _plan("cdua")


@pytest.mark.long  # 11 s in the default lane on 2 cores (2026-11-29)
def test_the_cli_plans_for_cuda_here():
    out = subprocess.run([sys.executable, "-m", "shardkit", "plan", "--backend", "cuda",
                          "--world-size", "8", "--hf-config", "gpt2", "--batch", "2", "--seq", "128"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "peak per rank at batch 2 x seq 128" in out.stdout


class MisdeclaredBackend(CPUBackend):
    """Runs attention the CUDA way but declares the CPU rule, and changes its capabilities once
    started: the planner would plan for facts the running backend does not have."""

    name = "misdeclared"

    def __init__(self) -> None:
        super().__init__()
        self.capabilities = dataclasses.replace(type(self).capabilities, shard_alignment=4)

    def runs_fused_attention(self, call: AttentionCall) -> bool:
        """CUDA's choice, not the declared one."""
        return sdpa_runs_fused(call)


@pytest.mark.timeout(120)
def test_conformance_catches_a_backend_that_is_not_what_it_declares():
    result = run_world(MisdeclaredBackend(), 1)
    assert result.failed_checks() == ["declared_facts"], repr(result)
    text = result.failure("declared_facts")
    assert "capabilities differ from the class's" in text
    assert "Capabilities.fused_attention says False" in text


# ---- inputs that used to end in a traceback, or in a wrong answer with exit status 0 ----------------
@pytest.mark.parametrize("argv,status,message", [
    (["--device-memory", "infGiB", "--seq", "8"], 2, "expected a size such as 80GiB"),
    (["--step-time", "10", "--link-gbps", "0"], 2, "--link-gbps: expected a number > 0, got '0'"),
    (["--step-time", "10", "--link-gbps", "-1"], 2, "expected a number > 0, got '-1'"),
    (["--step-time", "10", "--link-latency-us", "-5"], 2, "expected a number >= 0, got '-5'"),
    (["--set", "n_layer=abc"], 1, "GPT2Config.n_layer is an integer (now 12), got 'abc'"),
    (["--set", "n_layer=-1"], 1, "n_layer counts or sizes part of the model (now 12); it must be "
                                 "at least 1, got -1"),
    (["--set", "n_embd=1.5"], 1, "GPT2Config.n_embd is an integer (now 768), got '1.5'"),
    (["--set", "scale_attn_weights=1"], 1, "is true or false (now true), got '1'"),
    (["--batch", "1", "--seq", "5000"], 1, "--seq 5000 is longer than the 1024 positions of this "
                                           "GPT2Config (n_positions); HINT: plan a longer context "
                                           "with --set n_positions=5000"),
])
def test_plan_refuses_inputs_that_would_mislead(argv, status, message, capsys):
    pytest.importorskip("transformers")
    from shardkit.cli.main import main

    try:
        got = main(["plan", "--hf-config", "gpt2", "--world-size", "2", *argv])
    except SystemExit as exc:
        got = exc.code
    err = capsys.readouterr().err
    assert got == status and message in err, err


def test_a_longer_context_plans_once_the_positions_are_raised(capsys):
    pytest.importorskip("transformers")
    from shardkit.cli.main import main

    assert main(["plan", "--hf-config", "gpt2", "--set", "n_layer=1", "--set", "n_positions=2048",
                 "--world-size", "2", "--batch", "1", "--seq", "2048"]) == 0
    # Rotary models have no position table to run past: llama plans at any --seq.
    assert main(["plan", "--hf-config", "llama", "--set", "num_hidden_layers=1", "--set",
                 "hidden_size=256", "--set", "intermediate_size=512", "--set",
                 "num_attention_heads=4", "--world-size", "2", "--batch", "1", "--seq", "4096"]) == 0
    capsys.readouterr()


# ---- the allocator's headroom in "what fits" -----------------------------------------------------
def test_what_fits_keeps_the_allocators_headroom_free():
    from shardkit.planner import largest_batch

    budget = 64 * 2**20
    kw = dict(example_inputs=lambda batch, seq: ((torch.empty(batch, seq, 64, device="meta"),), {}))
    bare = largest_batch(_model(), 2, budget, 256, headroom=0.0, **kw)
    kept = largest_batch(_model(), 2, budget, 256, headroom=0.5, **kw)
    assert 0 < kept.batch < bare.batch, (kept.batch, bare.batch)
    assert kept.usable_memory == int(budget / 1.5) and kept.headroom == 0.5
    # The edge: the answer's peak fits the usable part, one more sample does not.
    assert kept.plan.peak_bytes <= kept.usable_memory
    over = shardkit.plan(_model(), world_size=2, batch=kept.batch + 1, seq=256, **kw)
    assert over.peak_bytes > kept.usable_memory
    assert "allocator headroom" in kept.summary()


def test_the_default_headroom_is_the_targets_declared_one():
    from shardkit.planner import largest_batch
    from shardkit.job.selection import backend_class

    assert backend_class("cuda").capabilities.allocator_headroom == 0.45
    assert backend_class("cpu").capabilities.allocator_headroom == 0.0
    kw = dict(example_inputs=lambda batch, seq: ((torch.empty(batch, seq, 64, device="meta"),), {}))
    on_cuda = largest_batch(_model(), 2, 64 * 2**20, 256, backend="cuda", **kw)
    assert on_cuda.headroom == 0.45 and on_cuda.usable_memory == int(64 * 2**20 / 1.45)
    assert largest_batch(_model(), 2, 64 * 2**20, 256, **kw).headroom == 0.0
    with pytest.raises(shardkit.ShardkitError, match="from 0 to 10"):
        largest_batch(_model(), 2, 64 * 2**20, 256, headroom=-0.1, **kw)


def test_the_cli_headroom_flag(capsys):
    pytest.importorskip("transformers")
    from shardkit.cli.main import main

    args = ["plan", "--hf-config", "gpt2", "--set", "n_layer=2", "--world-size", "2",
            "--device-memory", "4GiB", "--seq", "128", "--batch", "8"]
    assert main([*args, "--headroom", "25%"]) == 0
    out = capsys.readouterr().out
    assert "3.2 GiB planned, 25% allocator headroom" in out, out
    try:
        main(["plan", "--hf-config", "gpt2", "--world-size", "2", "--headroom", "30%"])
    except SystemExit:
        pass
    assert "--headroom is the allocator's share of --device-memory" in capsys.readouterr().err
