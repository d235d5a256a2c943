"""XLA backend decisions that need no torch_xla (they run in the default lane too)."""

from __future__ import annotations

from shardkit_backends.xla import XLABackend
import pytest

from shardkit.errors import ShardkitError
from shardkit_backends.xla.spawn import child_environment, spawn_timeout


def test_selected_only_when_pjrt_device_is_set(monkeypatch):
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    assert XLABackend.auto_select_now() is False
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    assert XLABackend.auto_select_now() is True


def test_capabilities_tell_the_engine_what_xla_needs():
    caps = XLABackend.capabilities
    assert (caps.supports_storage_resize, caps.shard_alignment, caps.needs_compiler_barrier,
            caps.needs_step_boundary, caps.ranks_share_process, caps.torch_process_group) == (
                False, 128, True, True, True, False)
    assert "avg" not in caps.reduce_ops and "sum" in caps.reduce_ops


def test_child_environment_sizes_the_cpu_client():
    assert child_environment(3, {"PJRT_DEVICE": "CPU"}) == {"CPU_NUM_DEVICES": "3",
                                                            "XLA_THREAD_POOL_SIZE": "8"}
    assert child_environment(6, {"PJRT_DEVICE": "CPU", "XLA_THREAD_POOL_SIZE": "64"}) == {
        "CPU_NUM_DEVICES": "6"}
    assert child_environment(2, {"PJRT_DEVICE": "TPU"}) == {}


def test_spawn_timeout_is_read_from_the_environment():
    assert spawn_timeout({}) is None and spawn_timeout({"SHARDKIT_XLA_SPAWN_TIMEOUT": "0"}) is None
    assert spawn_timeout({"SHARDKIT_XLA_SPAWN_TIMEOUT": "540"}) == 540.0
    with pytest.raises(ShardkitError, match="SHARDKIT_XLA_SPAWN_TIMEOUT='soon' is not a number"):
        spawn_timeout({"SHARDKIT_XLA_SPAWN_TIMEOUT": "soon"})
