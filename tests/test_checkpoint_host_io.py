"""The host-side checkpoint path (backends without a torch process group, e.g. XLA) on cpu/gloo.

The same model is saved twice by 2 gloo ranks: once through dcp.save, once through
checkpoint.host_io as a backend with ``torch_process_group=False`` does. Both checkpoints must hold
the same DCP entries and chunks, load back bit-exactly (through DCP with a process group, and through
the host path at another world size), and be equal to the model. Runs in the default lane, so the
host path is checked against the torch the default lane installs, not only torch_xla's.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

import shardkit
import shardkit.checkpoint as ck
from shardkit.checkpoint.dcp_io import FlatTensorReader

from _optim_state import local_optim
from _xla_workers import full_params, sharded_tinynet, train_steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _without_process_group(ctx) -> None:
    # This rank's backend instance only: the class (and other ranks' processes) keep theirs.
    ctx.backend.capabilities = dataclasses.replace(ctx.backend.capabilities,
                                                   torch_process_group=False)


def save_both_ways(rank: int, root: str) -> dict:
    ctx = shardkit.current_context()
    model, opt = sharded_tinynet(seed=0)
    train_steps(model, opt, 0, 2)
    ck.save(os.path.join(root, "dcp"), model, opt, extra={"step": 2})
    _without_process_group(ctx)
    ck.save(os.path.join(root, "host"), model, opt, extra={"step": 2})
    return {"params": full_params(model), "optim": local_optim(model, opt)}


def read_object(directory, key: str):
    """A pickled DCP entry as torch's own dcp.load reads it."""
    import torch.distributed.checkpoint as dcp

    state = {key: None}
    dcp.load(state, checkpoint_id=str(directory), no_dist=True)
    return state[key]


def load_one(rank: int, path: str, host: bool) -> dict:
    ctx = shardkit.current_context()
    if host:
        _without_process_group(ctx)
    model, opt = sharded_tinynet(seed=5)
    extra = ck.load(path, model, opt)
    return {"extra": extra, "params": full_params(model), "optim": local_optim(model, opt)}


@pytest.mark.slow
@pytest.mark.long  # 13 s: two writers, two loads
def test_host_path_writes_what_dcp_writes_and_both_load(tmp_path):
    saved = shardkit.spawn(save_both_ways, 2, str(tmp_path), backend="cpu", threads_per_rank=1)
    dcp_dir, host_dir = tmp_path / "dcp", tmp_path / "host"
    assert sorted(os.listdir(host_dir)) == sorted(os.listdir(dcp_dir))
    want, got = FlatTensorReader(str(dcp_dir)), FlatTensorReader(str(host_dir))
    assert want.metadata.state_dict_metadata.keys() == got.metadata.state_dict_metadata.keys()
    for key, md in want.metadata.state_dict_metadata.items():
        other = got.metadata.state_dict_metadata[key]
        if isinstance(md, BytesStorageMetadata):  # rank 0's param-group settings, for torch
            assert isinstance(other, BytesStorageMetadata), key
            assert read_object(dcp_dir, key) == read_object(host_dir, key), key
            continue
        assert (md.size, md.properties.dtype, sorted(c.offsets for c in md.chunks)) == (
            other.size, other.properties.dtype, sorted(c.offsets for c in other.chunks)), key
        assert torch.equal(want.read(key), got.read(key)), key
    for path, host, ranks in ((host_dir, False, 2), (dcp_dir, True, 3)):
        loaded = shardkit.spawn(load_one, ranks, str(path), host, backend="cpu", threads_per_rank=1)
        assert loaded[0]["extra"] == {"step": 2}
        for name, value in saved[0]["params"].items():
            assert torch.equal(loaded[0]["params"][name], value), (path, host, ranks, name)
        if ranks == 2:
            for rank in range(2):
                (pieces, steps), (got_pieces, got_steps) = saved[rank]["optim"], loaded[rank]["optim"]
                assert got_steps == steps and got_pieces.keys() == pieces.keys() and pieces
                for key, (offset, value, _) in pieces.items():
                    got_offset, got_value, _ = got_pieces[key]
                    assert got_offset == offset and torch.equal(got_value, value), key
