"""What the engine owns for every backend: the step boundary, the local-rank limit, logging,
deepcopy refusal and the swapped class, each shown with a stand-in backend in one process."""

from __future__ import annotations

import copy
import logging
import subprocess
import sys

import pytest
import torch
from torch import nn

import shardkit
from shardkit import Capabilities, hookimpl
from shardkit.errors import ShardkitError
from shardkit.testing import reset_state
from shardkit_backends.cpu import CPUBackend


class StepCountingCPU(CPUBackend):
    """gloo on the host, declaring that its graph needs a cut after every optimizer step."""

    name = "cpu-step-counting"
    capabilities = Capabilities(needs_step_boundary=True)
    boundaries = 0

    def step_boundary(self) -> None:
        """Count the calls the engine's optimizer post-hook makes."""
        type(self).boundaries += 1


class OneDeviceBackend(CPUBackend):
    """A one-device machine: like a single GPU, one rank per device (the default limit)."""

    name = "onedevice"

    def max_local_ranks(self) -> int | None:
        """One device, one local rank (what Backend's default says for device_count() == 1)."""
        return self.device_count()


class OneDevicePlugin:
    """Registers OneDeviceBackend by name, for the command line."""

    @hookimpl
    def shardkit_register_backends(self, registry) -> None:
        """Add the one-device backend."""
        registry.add(OneDeviceBackend)


@pytest.fixture
def clean_state():
    """No shardkit context or cached plugins before and after the test."""
    reset_state()
    yield
    reset_state()


def _train_steps(model: nn.Module, steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()


# ---- the step boundary is installed by the engine, not by a backend ------------------------------

def test_engine_cuts_the_step_for_any_backend_that_asks(clean_state) -> None:
    """A backend with needs_step_boundary gets step_boundary() after every opt.step(), copying no hook code."""
    StepCountingCPU.boundaries = 0
    shardkit.init(StepCountingCPU())
    _train_steps(shardkit.shard(nn.Linear(4, 2)), steps=3)
    assert StepCountingCPU.boundaries == 3
    reset_state()
    shardkit.init("cpu")  # the hook is process-wide but acts only for a backend that asks
    _train_steps(shardkit.shard(nn.Linear(4, 2)), steps=2)
    assert StepCountingCPU.boundaries == 3


# ---- more local ranks than devices: refused before any process starts ---------------------------

def test_spawn_refuses_more_ranks_than_devices_before_starting_any(clean_state) -> None:
    """The error names the device count and what to pass; no rank was started (so it is instant)."""
    with pytest.raises(ShardkitError) as info:
        shardkit.spawn(_train_steps, 2, backend=OneDeviceBackend())
    message = str(info.value)
    assert "2 local ranks" in message and "sees 1 cpu device(s)" in message
    assert "--nproc 1" in message and "nprocs=1" in message


def test_cli_demo_and_launch_refuse_more_ranks_than_devices(clean_state, capsys) -> None:
    """`shardkit demo --nproc 2` and `shardkit launch --nproc 2` on a one-device backend: a clear error."""
    from shardkit.cli.main import main

    shardkit.register_plugin(OneDevicePlugin(), "onedevice")
    assert main(["demo", "--backend", "onedevice", "--nproc", "2", "--epochs", "1"]) == 1
    err = capsys.readouterr().err
    assert "sees 1 cpu device(s)" in err and "--nproc 1" in err and "Traceback" not in err
    assert main(["launch", "--backend", "onedevice", "--nproc", "2", "--dry-run", "t.py"]) == 2
    assert "sees 1 cpu device(s)" in capsys.readouterr().err
    assert main(["launch", "--backend", "onedevice", "--dry-run", "t.py"]) == 0
    assert "--nproc-per-node=1" in capsys.readouterr().out  # default: one rank per device


def test_cpu_ranks_are_not_limited_by_devices() -> None:
    """The host backend runs as many ranks as asked: its limit is None, not its one device."""
    assert CPUBackend().max_local_ranks() is None


# ---- observability --------------------------------------------------------------------------------

def test_info_lines_name_backend_group_strategy_and_units(clean_state, caplog) -> None:
    """INFO on the "shardkit" logger: the backend and process group, the strategy, each unit and its size."""
    caplog.set_level(logging.DEBUG, logger="shardkit")
    shardkit.init("cpu")
    model = shardkit.shard(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)),
                           auto_wrap_policy=lambda m: isinstance(m, nn.Linear))
    _train_steps(model, steps=1)
    text = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("shardkit"))
    assert "backend 'cpu' on cpu, process group 'gloo' ready" in text
    assert "sharded Sequential with FULL_SHARD over a shard group of 1 rank(s) x 1 replica(s): 3 unit(s)" in text
    assert "unit '0': 2 parameter(s), 15 elements" in text  # 4*3 + 3
    assert "unit '1': 2 parameter(s), 8 elements" in text  # 3*2 + 2


@pytest.mark.slow
@pytest.mark.long  # 11 s: a fresh job with debug logging
def test_shardkit_log_env_prints_debug_lines_to_stderr() -> None:
    """SHARDKIT_LOG=debug sends the logger to stderr in a fresh interpreter, with no code change."""
    code = ("import shardkit, torch\nshardkit.init('cpu')\n"
            "m = shardkit.shard(torch.nn.Linear(4, 2))\nm(torch.randn(2, 4)).sum().backward()\n")
    env = {"SHARDKIT_LOG": "debug", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "[shardkit INFO pid" in proc.stderr and "process group 'gloo' ready" in proc.stderr
    assert "[shardkit DEBUG pid" in proc.stderr and "backend 'cpu': CPUBackend" in proc.stderr
    quiet = subprocess.run([sys.executable, "-c", code], env={"PATH": "/usr/bin:/bin"},
                           capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 0 and "[shardkit" not in quiet.stderr


def test_deepcopy_of_a_sharded_model_is_refused_with_a_hint(clean_state) -> None:
    """copy.deepcopy raises a ShardkitError saying what to do instead of 'cannot pickle ProcessGroup'."""
    shardkit.init("cpu")
    model = shardkit.shard(nn.Linear(4, 2))
    with pytest.raises(ShardkitError, match=r"deepcopy of a sharded Linear .*HINT: deepcopy the model before"):
        copy.deepcopy(model)


def test_the_swapped_class_is_made_once_per_original_class(clean_state) -> None:
    """Two models of one class share one Sharded class; the original class stays in its MRO."""
    shardkit.init("cpu")
    a, b = shardkit.shard(nn.Linear(4, 2)), shardkit.shard(nn.Linear(3, 3))
    c = shardkit.shard(nn.Sequential(nn.Linear(2, 2)))
    assert type(a) is type(b) and type(a) is not type(c)
    assert type(a).__name__ == "ShardedLinear" and isinstance(a, nn.Linear)
