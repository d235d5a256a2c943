"""Checkpoint file layer without processes: safetensors writer, manifest, crash recovery, safe metadata."""

from __future__ import annotations

import json
import os
import pickle
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardkit.checkpoint import manifest as mf
from shardkit.checkpoint.dcp_io import SafeFileSystemReader
from shardkit.checkpoint.errors import (CheckpointError, CheckpointNotFoundError, CorruptCheckpointError,
                                        IncompleteCheckpointError)
from shardkit.checkpoint.safetensors_io import (INDEX_FILE, SafetensorsLayout, parse_size,
                                                read_full_source)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool]


def _tensors(n=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(n):
        dtype = DTYPES[i % len(DTYPES)]
        shape = [(3, 5), (7,), (0, 4), (), (2, 3, 4)][i % 5]
        t = torch.randn(shape, generator=gen) * 50
        out[f"layer{i % 7}.{'abcdefgh'[i % 8]}{i}"] = t.to(dtype)
    return out


def _write(layout, directory, tensors):
    layout.create(directory)
    names = list(tensors)
    random.Random(1).shuffle(names)  # gathered units arrive in any order
    for name in names:
        layout.write(directory, name, tensors[name])
    layout.finish(directory)


def test_single_file_is_byte_identical_to_safetensors_library(tmp_path):
    tensors = _tensors()
    save_file(tensors, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    layout = SafetensorsLayout([(k, tuple(v.shape), v.dtype) for k, v in tensors.items()])
    _write(layout, tmp_path / "ours", tensors)
    assert os.listdir(tmp_path / "ours") == ["model.safetensors"]
    assert ((tmp_path / "ours" / "model.safetensors").read_bytes()
            == (tmp_path / "ref.safetensors").read_bytes())


def test_split_files_respect_the_size_limit_and_index(tmp_path):
    tensors = {f"w{i}": torch.randn(10, 10) for i in range(10)}  # 400 bytes each
    tensors["big"] = torch.randn(50, 10)  # larger than the limit: a file of its own
    layout = SafetensorsLayout([(k, tuple(v.shape), v.dtype) for k, v in tensors.items()], 1000)
    _write(layout, tmp_path, tensors)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-{i:05d}-of-00006.safetensors" for i in range(1, 7)]
    for f in files:
        part = load_file(tmp_path / f)
        assert sum(t.nbytes for t in part.values()) <= 1000 or list(part) == ["big"]
        assert all(index["weight_map"][k] == f for k in part)
    shapes, read = read_full_source(tmp_path)
    assert shapes == {k: tuple(v.shape) for k, v in tensors.items()}
    assert all(read(k, None).equal(v) for k, v in tensors.items())
    # Rows alone, read as a slice of the file: what each rank of a sharded model takes.
    assert all(read(k, (1, 3)).equal(v[1:3]) for k, v in tensors.items() if v.dim() and len(v) > 2)


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30
    assert parse_size(123) == 123 and parse_size("1.5MB") == 1_500_000
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")


def _complete_checkpoint(directory, payload=b"weights"):
    os.makedirs(directory)
    (directory / "data.bin").write_bytes(payload)
    mf.write_manifest(str(directory), {"step": len(payload)},
                      {"data.bin": mf.sha256_file(str(directory / "data.bin"))})


def test_replace_keeps_a_complete_checkpoint_at_every_instant(tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    _complete_checkpoint(path, b"old")
    _complete_checkpoint(tmp_path / "ckpt.tmp-1", b"newer")
    real_rename = os.rename
    calls = []

    def crash_on_second(src, dst):
        calls.append(src)
        if len(calls) == 2:
            raise KeyboardInterrupt("simulated crash between the two renames")
        real_rename(src, dst)

    monkeypatch.setattr(mf.os, "rename", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        mf.replace_dir(str(tmp_path / "ckpt.tmp-1"), str(path))
    monkeypatch.setattr(mf.os, "rename", real_rename)
    assert not path.exists()
    recovered = mf.resolve(str(path))  # the previous checkpoint, under its .old name
    assert recovered == str(path) + ".old" and mf.read_manifest(recovered)["step"] == 3
    mf.replace_dir(str(tmp_path / "ckpt.tmp-1"), str(path))  # the next save finishes the job
    assert mf.read_manifest(mf.resolve(str(path)))["step"] == 5
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_incomplete_missing_and_damaged_checkpoints_are_named(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint at"):
        mf.resolve(str(tmp_path / "nothing"))
    os.makedirs(tmp_path / "half.tmp-abc")
    with pytest.raises(IncompleteCheckpointError, match="half.tmp-abc"):
        mf.resolve(str(tmp_path / "half"))
    os.makedirs(tmp_path / "nomanifest")
    with pytest.raises(IncompleteCheckpointError, match="is empty: shardkit_manifest.json is missing"):
        mf.resolve(str(tmp_path / "nomanifest"))
    _complete_checkpoint(tmp_path / "ok", b"0123456789")
    m = mf.read_manifest(str(tmp_path / "ok"))["files"]["data.bin"]
    assert mf.check_file(str(tmp_path / "ok"), "data.bin", m) is None
    (tmp_path / "ok" / "data.bin").write_bytes(b"0123456788")
    assert "data.bin: sha256 differs" in mf.check_file(str(tmp_path / "ok"), "data.bin", m)
    (tmp_path / "ok" / "data.bin").write_bytes(b"01234")
    assert "data.bin: size 5 bytes, manifest says 10" in mf.check_file(str(tmp_path / "ok"),
                                                                       "data.bin", m)


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch exploited",))


def test_dcp_metadata_is_never_unpickled_as_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Exploit()))
    with pytest.raises(CorruptCheckpointError, match="refusing to load posix.system"):
        SafeFileSystemReader(str(tmp_path)).read_metadata()
    assert not (tmp_path / "exploited").exists()


def test_never_replaces_a_directory_it_did_not_write(tmp_path):
    from shardkit.checkpoint.errors import CheckpointError
    from shardkit.checkpoint.safetensors_io import is_weights_dir

    precious = tmp_path / "project"
    os.makedirs(precious)
    (precious / "notes.txt").write_text("keep me")
    for looks_like, what in ((mf.is_checkpoint_dir, "shardkit checkpoint"),
                             (is_weights_dir, "safetensors weights directory")):
        with pytest.raises(CheckpointError, match=f"is not a {what}; refusing to replace it"):
            mf.check_replaceable(str(precious), looks_like, what)
    assert (precious / "notes.txt").read_text() == "keep me"
    _complete_checkpoint(tmp_path / "ckpt")
    mf.check_replaceable(str(tmp_path / "ckpt"), mf.is_checkpoint_dir, "shardkit checkpoint")
    mf.check_replaceable(str(tmp_path / "absent"), is_weights_dir, "safetensors weights directory")


@pytest.mark.parametrize("call", ["save", "load"])
def test_the_model_where_the_path_goes_is_named_before_any_peer_is_asked(call, tmp_path):
    # Found as a user from the wheel: save(model, path) failed inside os.fspath with a TypeError.
    import shardkit.checkpoint as ckpt
    from shardkit import ShardkitError

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ShardkitError, match=rf"{call}\(\) takes the path first.*HINT"):
        getattr(ckpt, call)(model, str(tmp_path / "ckpt"))
    with pytest.raises(ShardkitError, match="needs the model as its second argument"):
        getattr(ckpt, call)(str(tmp_path / "ckpt"), "model")


@pytest.mark.parametrize("name, files, says, deletable", [
    ("ckpt.tmp-00ab12cd34ef", [".metadata", "__0_0.distcp"], "a save that never finished", True),
    ("dcp", [".metadata", "__0_0.distcp"], "is a torch DCP checkpoint", False),
    ("hf", ["config.json", "model-00001-of-00002.safetensors"], "Hugging Face or safetensors", False),
    ("lost", [mf.STATE_FILE, ".metadata"], "holds a shardkit checkpoint's files but", False),
    ("empty", [], "is empty", False),
    ("other", ["notes.txt"], "is not a shardkit checkpoint", False),
])
def test_a_folder_without_a_manifest_is_named_for_what_it_holds(tmp_path, name, files, says,
                                                                   deletable):
    # Issue 54: a valid FSDP2 / torchtitan DCP folder was called "an incomplete checkpoint ...
    # HINT: ... delete this directory". Only shardkit's own unfinished save (its temporary name)
    # may be called safe to delete.
    folder = tmp_path / name
    folder.mkdir()
    for f in files:
        (folder / f).write_bytes(b"x")
    with pytest.raises(IncompleteCheckpointError) as err:
        mf.read_manifest(str(folder))
    message = str(err.value)
    assert says in message and "shardkit_manifest.json is missing" in message, message
    assert ("safe to delete" in message) is deletable, message
    assert "delete this directory" not in message
    # Only a folder torch DCP wrote is read by checkpoint.load as one (not shardkit's unfinished
    # save, not a shardkit checkpoint whose manifest was lost, though both hold .metadata).
    assert mf.is_torch_dcp(str(folder)) is (name == "dcp")


def test_a_save_never_replaces_a_folder_that_is_not_a_shardkit_checkpoint(tmp_path):
    # A torch DCP checkpoint at the save's path was taken for an unfinished shardkit save and
    # replaced (deleted) by checkpoint.save.
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": {"w": torch.ones(3)}}, checkpoint_id=str(tmp_path / "fsdp2"), no_dist=True)
    before = sorted(os.listdir(tmp_path / "fsdp2"))
    assert not mf.is_checkpoint_dir(str(tmp_path / "fsdp2"))
    with pytest.raises(CheckpointError, match="is not a shardkit checkpoint; refusing to replace"):
        mf.check_replaceable(str(tmp_path / "fsdp2"), mf.is_checkpoint_dir, "shardkit checkpoint")
    assert sorted(os.listdir(tmp_path / "fsdp2")) == before
    _complete_checkpoint(tmp_path / "ours", b"0123")
    (tmp_path / "empty").mkdir()
    assert mf.is_checkpoint_dir(str(tmp_path / "ours")) and mf.is_checkpoint_dir(str(tmp_path / "empty"))


def _save_a_model_named_like_the_optimizer(rank, root):
    import shardkit
    import shardkit.checkpoint as ckpt

    model = shardkit.shard(torch.nn.ModuleDict(
        {"optimizer": torch.nn.ModuleDict({"state": torch.nn.Linear(2, 2)})}))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        ckpt.save(os.path.join(root, "ckpt"), model, opt)
        said = "saved"
    except CheckpointError as exc:
        said = str(exc)
    left = sorted(os.listdir(root))
    ckpt.save(os.path.join(root, "model_only"), model)  # the model's names alone are fine
    return said, left


@pytest.mark.slow  # a spawned rank
def test_a_model_entry_named_like_the_optimizers_is_refused_before_anything_is_written(tmp_path):
    # A checkpoint keeps the model's names at the top level beside `optimizer.state.*`
    # (torchtitan's layout): such a name could take the place of the optimizer's entry.
    import shardkit

    said, left = shardkit.spawn(_save_a_model_named_like_the_optimizer, 1, str(tmp_path),
                                backend="cpu", threads_per_rank=1)[0]
    assert "optimizer.state.weight" in said and "HINT" in said, said
    assert left == []
    assert mf.read_manifest(str(tmp_path / "model_only"))["model"].keys() == {
        "optimizer.state.weight", "optimizer.state.bias"}
