"""The XPU backend's decisions, checked against a stand-in device module (no XPU exists here).

`FakeXpuModule` and `FakeXpuRuntime` are stand-ins for torch.xpu and for what an XPU torch install
offers; they only record what the backend asks of them. Nothing here runs on an Intel GPU: the
tests marked `hardware` at the bottom do, and they skip on machines without one.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import types
import warnings

import pytest
import torch

import shardkit
from shardkit.errors import BackendUnavailableError, ShardkitError
from shardkit.launch_env import detect_launch_env
from shardkit.testing import CHECK_NAMES
from shardkit_backends.xpu import XPUBackend
from shardkit_backends.xpu.collectives import CHOICES, choose_process_group
from shardkit_backends.xpu.runtime import INTEL_INDEX, TORCH_XPU_INDEX, XpuRuntime


class FakeXpuStream:
    """Stand-in for torch.xpu.Stream: remembers its device."""

    def __init__(self, device=None):
        self.device = torch.device(device) if device is not None else None


class FakeXpuEvent:
    """Stand-in for torch.xpu.Event."""


class FakeXpuModule:
    """Stand-in for the torch.xpu module, recording every call the backend makes."""

    def __init__(self, count=4, bf16=True, fp64=True, available=True):
        self.count, self.bf16, self.fp64, self.available = count, bf16, fp64, available
        self.calls: list[tuple] = []
        self.current = 0
        self.Stream = FakeXpuStream
        self.Event = FakeXpuEvent
        self.entered: list[FakeXpuStream] = []

    def is_available(self):
        return self.available

    def device_count(self):
        return self.count

    def set_device(self, device):
        self.calls.append(("set_device", torch.device(device)))
        self.current = torch.device(device).index

    def current_device(self):
        return self.current

    def current_stream(self, device=None):
        return FakeXpuStream(device)

    @contextlib.contextmanager
    def stream(self, s):
        self.entered.append(s)
        yield s

    def synchronize(self, device=None):
        self.calls.append(("synchronize", device))

    def memory_allocated(self, device=None):
        return 1234

    def max_memory_allocated(self, device=None):
        return 5678

    def reset_peak_memory_stats(self, device=None):
        self.calls.append(("reset_peak", device))

    def is_bf16_supported(self):
        return self.bf16

    def get_device_properties(self, index):
        return types.SimpleNamespace(name="stand-in", has_fp64=self.fp64)


class FakeXpuRuntime(XpuRuntime):
    """Stand-in for an XPU torch install: which collective stacks exist, and whether ccl was loaded."""

    def __init__(self, module=None, xccl=True, ccl=False):
        self.module = module if module is not None else FakeXpuModule()
        self.xccl, self.ccl, self.ccl_loads = xccl, ccl, 0

    def device_module(self):
        return self.module

    def xccl_available(self):
        return self.xccl

    def ccl_installed(self):
        return self.ccl

    def load_ccl(self):
        self.ccl_loads += 1

    def package_versions(self):
        return {"oneccl_bind_pt": "stand-in"} if self.ccl else {}


class NoXpuModuleRuntime(FakeXpuRuntime):
    """Stand-in for a torch build with no torch.xpu at all."""

    def device_module(self):
        return None


def standin(xccl=True, ccl=False, process_group=None, **module_kwargs) -> XPUBackend:
    """An XPUBackend whose runtime is the stand-in."""
    return XPUBackend(process_group=process_group,
                      runtime=FakeXpuRuntime(FakeXpuModule(**module_kwargs), xccl=xccl, ccl=ccl))


@pytest.fixture
def clean_env(monkeypatch):
    """Remove launcher variables and restore the whole environment afterwards (export() writes it)."""
    saved = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE",
                "SLURM_PROCID", "SLURM_NTASKS", "SHARDKIT_XPU_PG"):
        os.environ.pop(key, None)
    yield os.environ
    os.environ.clear()
    os.environ.update(saved)
    from shardkit.launch_env import _replaced_environ

    _replaced_environ.clear()  # export() noted what it replaced; this fixture put all of it back


# ---- registration and availability on this machine ------------------------------------------
def test_registered_through_the_plugin_registry():
    from shardkit.plugin.manager import plugin_state

    assert plugin_state().registry.get("xpu") is XPUBackend


@pytest.mark.skipif(XpuRuntime().device_module() is not None
                    and XpuRuntime().device_module().is_available(), reason="an XPU is present")
def test_unavailable_here_with_actionable_error():
    assert not XPUBackend.is_available()
    with pytest.raises(BackendUnavailableError) as err:
        shardkit.get_backend("xpu")
    text = str(err.value)
    assert "sees no Intel XPU device" in text and TORCH_XPU_INDEX in text and "HINT:" in text


def test_standin_availability_follows_the_device_module(monkeypatch):
    monkeypatch.setattr(XPUBackend, "runtime", FakeXpuRuntime(FakeXpuModule(available=True)))
    assert XPUBackend.is_available()
    monkeypatch.setattr(XPUBackend, "runtime", FakeXpuRuntime(FakeXpuModule(available=False)))
    assert not XPUBackend.is_available()
    monkeypatch.setattr(XPUBackend, "runtime", NoXpuModuleRuntime())
    assert not XPUBackend.is_available()
    assert "no torch.xpu module" in XPUBackend.unavailable_reason()


# ---- device normalisation (the FSDP-on-XPU-falls-back-to-CUDA pitfall) ------------------------
@pytest.mark.parametrize("device_id, local_rank, expected", [
    (None, 3, "xpu:3"),
    ("xpu", 2, "xpu:2"),            # index-less: the LlamaFactory#8003 case
    (torch.device("xpu"), 1, "xpu:1"),
    (2, 0, "xpu:2"),                # a bare int is an XPU index, never a CUDA one
    ("xpu:1", 3, "xpu:1"),
    (None, 5, "xpu:1"),             # more local ranks than devices wrap around
])
def test_device_normalisation_always_gives_an_indexed_xpu(device_id, local_rank, expected):
    dev = standin(count=4).normalize_device(device_id, local_rank)
    assert dev == torch.device(expected) and dev.type == "xpu" and dev.index is not None


def test_device_normalisation_rejects_other_device_types_and_bad_indices():
    be = standin(count=2)
    with pytest.raises(ShardkitError, match="'cuda' device but the 'xpu' backend"):
        be.normalize_device("cuda:0", 0)
    with pytest.raises(ShardkitError, match="out of range"):
        be.normalize_device(5, 0)
    with pytest.raises(ShardkitError, match="negative"):
        be.normalize_device(-1, 0)


def test_init_sets_the_normalised_device_and_binds_xccl_to_it_under_mpirun(clean_env, monkeypatch):
    import torch.distributed as dist

    # What oneCCL's docs launch with: mpirun exporting PMI_RANK/PMI_SIZE and MPI_LOCALRANKID.
    clean_env.update({"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1",
                      "MPI_LOCALNRANKS": "4", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29999"})
    seen = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: seen.update(kw))
    # The job's store is checked by shardkit.rendezvous (tested in test_two_jobs.py); here no
    # connection to the launcher's address may be made.
    joined = []
    monkeypatch.setattr("shardkit.job.rendezvous.join_job_store",
                        lambda env, timeout: joined.append((env.rank, env.master_addr,
                                                            env.master_port)) or dist.HashStore())
    monkeypatch.setattr(dist, "get_rank", lambda: 5)
    monkeypatch.setattr(dist, "get_world_size", lambda: 8)
    be = standin(count=4)
    env = detect_launch_env()
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (5, 8, 1, "mpich/intel-mpi")
    device = be.normalize_device("xpu", env.local_rank)
    be.set_device(device)
    from shardkit.job.rendezvous import with_job_store

    timeout = datetime.timedelta(seconds=5)
    world = be.init_process_group(with_job_store(env, timeout), timeout)  # as shardkit.init() does
    assert be.runtime.module.calls == [("set_device", torch.device("xpu:1"))]
    assert seen["backend"] == "xccl" and seen["device_id"] == torch.device("xpu:1")
    assert (seen["rank"], seen["world_size"]) == (5, 8)
    assert joined == [(5, "10.0.0.1", 29999)] and isinstance(seen["store"], dist.PrefixStore)
    assert (world.rank, world.size) == (5, 8)
    assert clean_env["RANK"] == "5" and clean_env["LOCAL_RANK"] == "1"


# ---- xccl vs the legacy ccl ---------------------------------------------------------------------
def test_auto_prefers_native_xccl(clean_env):
    be = standin(xccl=True, ccl=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert be.process_group_backend() == "xccl"
    assert be.runtime.ccl_loads == 0


def test_auto_falls_back_to_installed_bindings_with_a_deprecation_warning(clean_env):
    be = standin(xccl=False, ccl=True)
    with pytest.warns(FutureWarning, match="legacy oneCCL 'ccl'.*no xccl"):
        assert be.process_group_backend() == "ccl"
    assert be.process_group_backend() == "ccl"
    assert be.runtime.ccl_loads == 1  # importing the bindings registers "ccl"; once is enough


def test_neither_library_gives_both_install_hints(clean_env):
    be = standin(xccl=False, ccl=False)
    with pytest.raises(BackendUnavailableError) as err:
        be.process_group_backend()
    text = str(err.value)
    assert "no xccl backend" in text and "oneccl_bindings_for_pytorch is not installed" in text
    assert "HINT:" in text and TORCH_XPU_INDEX in text and INTEL_INDEX in text
    assert "Intel's index" in text


def test_env_var_requests_ccl_even_when_xccl_exists(clean_env):
    clean_env["SHARDKIT_XPU_PG"] = "ccl"
    be = standin(xccl=True, ccl=True)
    with pytest.warns(FutureWarning, match="it was requested"):
        assert be.process_group_backend() == "ccl"
    assert be.process_group_options(detect_launch_env()) == {}  # legacy group stays unbound


def test_requested_ccl_without_bindings_says_where_to_get_them(clean_env):
    clean_env["SHARDKIT_XPU_PG"] = "ccl"
    with pytest.raises(BackendUnavailableError, match="oneccl_bind_pt.*extra-index-url"):
        standin(xccl=True, ccl=False).process_group_backend()


def test_requested_xccl_on_a_torch_without_it(clean_env):
    clean_env["SHARDKIT_XPU_PG"] = "xccl"
    with pytest.raises(BackendUnavailableError, match="torch >= 2.8"):
        standin(xccl=False, ccl=True).process_group_backend()


def test_constructor_option_beats_the_env_var(clean_env):
    clean_env["SHARDKIT_XPU_PG"] = "xccl"
    with pytest.warns(FutureWarning):
        assert standin(xccl=True, ccl=True, process_group="ccl").process_group_backend() == "ccl"


def test_unknown_choice_is_refused(clean_env):
    clean_env["SHARDKIT_XPU_PG"] = "nccl"
    with pytest.raises(ShardkitError, match="SHARDKIT_XPU_PG='nccl'.*auto, xccl, ccl"):
        standin().process_group_backend()
    with pytest.raises(ShardkitError, match="process_group='mpi'"):
        XPUBackend(process_group="mpi")


@pytest.mark.parametrize("requested", CHOICES)
@pytest.mark.parametrize("xccl", [True, False])
@pytest.mark.parametrize("ccl", [True, False])
def test_choice_table(requested, xccl, ccl):
    expected = {"xccl": "xccl" if xccl else None, "ccl": "ccl" if ccl else None,
                "auto": "xccl" if xccl else ("ccl" if ccl else None)}[requested]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if expected is None:
            with pytest.raises(BackendUnavailableError, match="HINT:"):
                choose_process_group(requested, xccl, ccl)
        else:
            assert choose_process_group(requested, xccl, ccl) == expected


# ---- launchers, DDP, dtypes, streams, memory ----------------------------------------------------
def test_ddp_kwargs():
    be = standin()
    assert be.ddp_kwargs(torch.device("xpu:2")) == {"device_ids": [2], "output_device": 2}


@pytest.mark.parametrize("bf16, fp64", [(True, True), (False, False)])
def test_supports_dtype_asks_the_device(bf16, fp64):
    be = standin(bf16=bf16, fp64=fp64)
    assert be.supports_dtype(torch.bfloat16) is bf16
    assert be.supports_dtype(torch.float64) is fp64  # Arc A-series has no native fp64
    assert be.supports_dtype(torch.float32) and be.supports_dtype(torch.float16)
    assert not be.supports_dtype(torch.int64)


def test_streams_and_events_come_from_the_device_module():
    be = standin()
    module = be.runtime.module
    dev = torch.device("xpu:1")
    stream = be.new_stream(dev)
    assert isinstance(stream, FakeXpuStream) and stream.device == dev
    assert isinstance(be.current_stream(dev), FakeXpuStream)
    with be.use_stream(stream) as active:
        assert active is stream
    assert module.entered == [stream]
    assert isinstance(be.new_event(), FakeXpuEvent)
    be.synchronize(dev)
    assert ("synchronize", dev) in module.calls


def test_memory_stats_come_from_the_device_module():
    be = standin()
    assert be.memory_stats(torch.device("xpu:0")) == {"allocated": 1234, "peak": 5678}
    be.reset_peak_memory(torch.device("xpu:0"))
    assert ("reset_peak", torch.device("xpu:0")) in be.runtime.module.calls


def test_versions_report_the_collective_stack(monkeypatch):
    monkeypatch.setattr(XPUBackend, "runtime", FakeXpuRuntime(xccl=False, ccl=True))
    assert XPUBackend.versions()["xccl"] == "False"
    assert XPUBackend.versions()["oneccl_bind_pt"] == "stand-in"


# ---- real hardware (never runs here) -----------------------------------------------------------
def _xpu_present() -> bool:
    module = XpuRuntime().device_module()
    return module is not None and bool(module.is_available())


@pytest.fixture(scope="module")
def real_xpu_conformance():
    """The conformance suite's result on a real XPU at world size 1 (computed once)."""
    from shardkit.testing import run_world

    return run_world("xpu", 1)


@pytest.mark.hardware
@pytest.mark.skipif(not _xpu_present(), reason="needs a real Intel XPU and torch's XPU build")
@pytest.mark.parametrize("check", CHECK_NAMES)
def test_real_xpu_conformance_world_size_one(check, real_xpu_conformance):
    assert real_xpu_conformance.failure(check) is None, real_xpu_conformance.failure(check)
