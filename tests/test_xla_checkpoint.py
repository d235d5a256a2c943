"""Sharded checkpoints on XLA (PJRT_DEVICE=CPU) and across backends: xla <-> cpu/gloo, 1-3 ranks.

XLA ranks are device threads of one process with no torch process group, so the xla backend writes
DCP files from host copies of its shards (shardkit.checkpoint.host_io). These tests prove the files
are the ones `load` reads everywhere: saved on xla (2 devices) and loaded on gloo at 1 and 3 ranks,
saved on gloo (2 ranks) and loaded on xla (2 devices), parameters and optimizer state bit-exact,
the next steps' losses equal to the saving run's. Skipped where torch_xla is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from safetensors.torch import load_file

import _xla_workers
from _xla_workers import cpu_pjrt  # noqa: F401 - autouse fixture: XLA on the CPU client
from _optim_state import assemble_optim
import shardkit
import shardkit.checkpoint as ck
from shardkit.checkpoint.dcp_io import FlatTensorReader

HAS_XLA = importlib.util.find_spec("torch_xla") is not None
pytestmark = [pytest.mark.xla, pytest.mark.slow,
              pytest.mark.skipif(not HAS_XLA, reason="torch_xla is not installed (XLA lane only)")]
# Losses after a load: the same arithmetic at another world size or on another backend, up to
# rounding (observed <= 1.2e-7); a wrong shard offset or a stale optimizer state moves them by > 1e-3.
LOSS_TOL = 1e-5


def _spawn(fn, n, *args, backend):
    if backend == "cpu":
        return shardkit.spawn(fn, n, *args, backend="cpu", threads_per_rank=1)
    return shardkit.spawn(fn, n, *args, backend=backend)


@pytest.fixture(scope="module")
def xla_saved(tmp_path_factory):
    """2 XLA devices: 3 steps, save, export, 2 more steps."""
    root = str(tmp_path_factory.mktemp("xla_saved"))
    with pytest.MonkeyPatch.context() as mp:
        for key, value in _xla_workers.XLA_TEST_ENV.items():
            mp.setenv(key, value)
        runs = _spawn(_xla_workers.save_then_train, 2, root, backend="xla")
    return root, runs


def _assert_same_state(saved: list[dict], loaded: list[dict]) -> None:
    for run in loaded:
        assert run["params"].keys() == saved[0]["params"].keys()
        for name, value in saved[0]["params"].items():
            assert torch.equal(run["params"][name], value), name
    want, want_steps = assemble_optim([r["optim"] for r in saved])
    got, got_steps = assemble_optim([r["optim"] for r in loaded])
    assert want.keys() == got.keys() and len(want) > 0 and got_steps == want_steps
    for key, value in want.items():
        assert not value.isnan().any() and torch.equal(got[key], value), key


def _global_losses(runs: list[dict]) -> list[float]:
    # Equal slices of one global batch: the global mean loss is the mean of the ranks' losses.
    return [sum(r["after"][i] for r in runs) / len(runs) for i in range(len(runs[0]["after"]))]


def _assert_resumes(saved: list[dict], loaded: list[dict]) -> float:
    _assert_same_state(saved, loaded)
    want, got = _global_losses(saved), _global_losses(loaded)
    diff = max(abs(a - b) for a, b in zip(want, got))
    assert diff <= LOSS_TOL, (want, got)
    return diff


def test_xla_checkpoint_has_the_layout_of_every_backend(xla_saved):
    root, runs = xla_saved
    assert [r["backend"] for r in runs] == ["xla", "xla"]
    assert [r["device"] for r in runs] == ["xla:0", "xla:1"]
    path = os.path.join(root, "ckpt")
    files = sorted(os.listdir(path))
    # One DCP file per rank, DCP's global metadata, shardkit's state and manifest; nothing else
    # (the per-rank plans that built the metadata are gone), no temporary directory left.
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "shardkit_manifest.json",
                     "shardkit_state.pt"], files
    assert sorted(os.listdir(root)) == ["ckpt", "export"]
    with open(os.path.join(path, "shardkit_manifest.json")) as f:
        manifest = json.load(f)
    assert (manifest["backend"], manifest["world_size"], manifest["step"]) == ("xla", 2, 3)
    assert set(manifest["files"]) == set(files) - {"shardkit_manifest.json"}
    # Every tensor is stored under its name and full shape, as FSDP2 writes it: its chunks are
    # blocks of whole rows that cover it exactly (0-d: one chunk); the rest are rank 0's
    # param-group settings, for torch's readers.
    reader = FlatTensorReader(path)
    for key, md in reader.metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            assert key.startswith("optimizer.param_groups."), key
            continue
        if len(md.size) == 0:
            assert len(md.chunks) == 1, key
            continue
        assert all(tuple(c.sizes[1:]) == tuple(md.size[1:]) for c in md.chunks), key
        assert sum(c.sizes[0] for c in md.chunks) == md.size[0], key
    for name, value in runs[0]["params"].items():
        assert torch.equal(reader.read(name), value), name
    # torch's own dcp.load, no shardkit and no process group, reads the model back.
    import torch.distributed.checkpoint as dcp

    plain = {name: torch.empty_like(value) for name, value in runs[0]["params"].items()}
    dcp.load(plain, checkpoint_id=path, no_dist=True)
    for name, value in runs[0]["params"].items():
        assert torch.equal(plain[name], value), name


def test_consolidate_inspect_export_on_an_xla_checkpoint(xla_saved, tmp_path):
    root, runs = xla_saved
    path = os.path.join(root, "ckpt")
    env = {**os.environ, "SHARDKIT_BACKEND": "cpu"}
    env.pop("PJRT_DEVICE", None)
    out = tmp_path / "weights"
    proc = subprocess.run([sys.executable, "-m", "shardkit", "consolidate", path, str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    consolidated = load_file(str(out / "model.safetensors"))
    exported = load_file(os.path.join(root, "export", "model.safetensors"))
    assert consolidated.keys() == exported.keys() == runs[0]["params"].keys()
    for name, value in runs[0]["params"].items():
        assert torch.equal(consolidated[name], value) and torch.equal(exported[name], value), name
    proc = subprocess.run([sys.executable, "-m", "shardkit", "inspect", path],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    info = ck.inspect_checkpoint(path)
    assert (info["world_size"], info["backend"], info["step"]) == (2, "xla", 3)
    assert "optimizer.state.blocks.0.fc1.weight.exp_avg" in info["optimizer"]
    assert "world size   2" in proc.stdout and "blocks.0.qkv.weight" in proc.stdout, proc.stdout


@pytest.mark.parametrize("ranks", [1, 3])
def test_xla_checkpoint_resumes_on_gloo(xla_saved, ranks):
    root, saved = xla_saved
    loaded = _spawn(_xla_workers.load_then_train, ranks, os.path.join(root, "ckpt"), backend="cpu")
    assert all(r["backend"] == "cpu" for r in loaded)
    assert loaded[0]["extra"] == {"step": 3, "saved_on": "xla"}
    diff = _assert_resumes(saved, loaded)
    print(f"xla(2) -> gloo({ranks}): save {max(r['save_s'] for r in saved):.2f} s, load "
          f"{max(r['load_s'] for r in loaded):.2f} s, next losses max diff {diff:.1e}")


def test_xla_background_save_resumes_on_gloo(tmp_path):
    """save(background=True) on 2 XLA device threads while training goes on; loaded on gloo."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in _xla_workers.XLA_TEST_ENV.items():
            mp.setenv(key, value)
        saved = _spawn(_xla_workers.save_then_train, 2, str(tmp_path), True, backend="xla")
    loaded = _spawn(_xla_workers.load_then_train, 2, str(tmp_path / "ckpt"), backend="cpu")
    _assert_resumes(saved, loaded)


def test_gloo_checkpoint_resumes_on_xla(tmp_path):
    saved = _spawn(_xla_workers.save_then_train, 2, str(tmp_path), backend="cpu")
    loaded = _spawn(_xla_workers.load_then_train, 2, str(tmp_path / "ckpt"), backend="xla")
    assert [r["device"] for r in loaded] == ["xla:0", "xla:1"]
    assert loaded[0]["extra"] == {"step": 3, "saved_on": "cpu"}
    diff = _assert_resumes(saved, loaded)
    print(f"gloo(2) -> xla(2): save {max(r['save_s'] for r in saved):.2f} s, load "
          f"{max(r['load_s'] for r in loaded):.2f} s, next losses max diff {diff:.1e}")
