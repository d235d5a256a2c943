"""A backend's device side paired with another's collectives ("cpu+gloo", "cuda+gloo"): the split
of members and capabilities, selection and its errors, and the pair running the engine."""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import pickle

import pytest
import torch

import shardkit
from shardkit import Backend, Capabilities
from shardkit.backend import CollectiveSide, DeviceSide, side_members
from shardkit.composed import COLLECTIVE_FIELDS, ComposedBackend, composed_capabilities, composed_class
from shardkit.errors import BackendNotFoundError, ShardkitError, UnsupportedOperationError
from shardkit.job.selection import get_backend
from shardkit.testing import run_world
from shardkit_backends.cpu import CPUBackend

from _one_device_workers import one_device_suite


def test_every_backend_member_belongs_to_one_side_or_to_the_backend_itself():
    public = {name for name, _ in inspect.getmembers(Backend, callable) if not name.startswith("_")}
    devices, collectives = set(side_members(DeviceSide)), set(side_members(CollectiveSide))
    assert not devices & collectives, "a member is on two sides"
    own = {name for name, value in vars(Backend).items()
           if (callable(value) or isinstance(value, classmethod)) and not name.startswith("_")}
    assert devices | collectives | own == public
    assert own == {"is_available", "requirement_hint", "unavailable_reason", "auto_select_now",
                   "versions", "max_local_ranks"}  # class facts, and ranks per machine (the pair's call)


def test_a_pair_is_its_two_sides_and_a_member_called_on_it_is_its_sides():
    def marked(backend_name):
        class Marked(CPUBackend):
            name = backend_name

            def new_stream(self, device):
                return backend_name

            def barrier(self, group):
                return backend_name
        return Marked

    devices_cls, collectives_cls = marked("devices_test"), marked("collectives_test")
    pair = composed_class(devices_cls, collectives_cls)()
    assert pair.devices is pair.device_backend and pair.collectives is pair.collective_backend
    assert pair.devices is not pair.collectives
    # A user's script calling the pair itself gets each side's own override, not Backend's default.
    assert pair.new_stream(torch.device("cpu")) == "devices_test"
    assert pair.barrier(None) == "collectives_test"
    devices, collectives = side_members(DeviceSide), side_members(CollectiveSide)
    assert all(getattr(ComposedBackend, m).__doc__.startswith(f"`backend.devices.{m}`") for m in devices)
    assert all(getattr(ComposedBackend, m).__doc__.startswith(f"`backend.collectives.{m}`")
               for m in collectives)


def test_capabilities_follow_the_collective_side_for_collective_fields():
    device = Capabilities(has_streams=True, supports_storage_resize=True, shard_alignment=8,
                          allocator_headroom=0.45, direct_collective_numel=None,
                          exact_reduce_ops=frozenset({"avg", "premul_sum"}),
                          default_timeout=datetime.timedelta(minutes=10))
    collectives = Capabilities(has_streams=False, async_collectives=False, shard_alignment=1,
                               supports_storage_resize=False, direct_collective_numel=1 << 20,
                               reduce_ops=frozenset({"sum"}), exact_reduce_ops=frozenset(),
                               supported_dtypes=frozenset({torch.float32, torch.bfloat16}),
                               default_timeout=datetime.timedelta(seconds=30))
    pair = composed_capabilities(device, collectives)
    for name in COLLECTIVE_FIELDS:
        assert getattr(pair, name) == getattr(collectives, name), name
    assert (pair.has_streams, pair.supports_storage_resize, pair.allocator_headroom,
            pair.direct_collective_numel) == (True, True, 0.45, None)
    assert pair.exact_reduce_ops == frozenset()  # gloo-style: the engine sums and divides
    assert pair.supported_dtypes == {torch.float32, torch.bfloat16}
    assert pair.default_timeout == datetime.timedelta(minutes=10)


class _OneDevice(CPUBackend):
    """A host device that says it holds one device per rank, as a GPU backend does."""

    name = "one_device_test"
    collective_libraries = ()
    capabilities = dataclasses.replace(CPUBackend.capabilities, has_streams=False, shard_alignment=16)

    def max_local_ranks(self):
        return 1


def test_ranks_per_machine_are_the_collective_librarys_call():
    shared = composed_class(_OneDevice, CPUBackend)()  # gloo: any number of ranks per device
    assert shared.max_local_ranks() is None
    assert shared.capabilities.shard_alignment == 1  # the collectives' padding
    own = composed_class(_OneDevice, _OneDevice)()  # a library with one rank per device
    assert own.max_local_ranks() == 1
    assert own.name == "one_device_test+one_device_test"


def test_a_pair_is_named_by_its_library_and_resolved_once():
    pair = get_backend("cpu+gloo")
    assert isinstance(pair, ComposedBackend)
    assert pair.name == "cpu+gloo" and pair.device_type == "cpu"
    assert get_backend("cpu+cpu") is pair and get_backend(" cpu + gloo ") is pair
    assert pair.devices is get_backend("cpu") and pair.collectives is get_backend("cpu")
    assert type(pair).capabilities == pair.capabilities  # a class fact, as the planner reads it
    again = pickle.loads(pickle.dumps(pair))
    assert again.name == "cpu+gloo" and type(again).capabilities == type(pair).capabilities
    assert type(pair).is_available() and "torch" in type(pair).versions()


@pytest.mark.parametrize("spec, error, words", [
    ("cpu+glo", BackendNotFoundError, ["did you mean 'gloo'", "Valid collective sides", "nccl"]),
    ("cpu+", ShardkitError, ["'DEVICE+COLLECTIVES'", "cuda+gloo"]),
    ("+gloo", ShardkitError, ["'DEVICE+COLLECTIVES'"]),
    ("cpu+gloo+nccl", ShardkitError, ["with one '+'"]),
    ("cdua+gloo", BackendNotFoundError, ["did you mean 'cuda'"]),
])
def test_a_wrong_pair_says_what_to_write(spec, error, words):
    with pytest.raises(error) as info:
        get_backend(spec)
    assert all(w in str(info.value) for w in words), str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_a_pair_with_a_device_missing_here_names_its_extra():
    with pytest.raises(ShardkitError, match=r"(?s)^'cuda\+gloo': backend 'cuda' is not available.*HINT: .*\[cuda\]"):
        get_backend("cuda+gloo")


def test_collectives_outside_torch_process_groups_pair_only_with_their_device():
    class Own(CPUBackend):
        name = "own_collectives_test"
        device_type = "meta"
        capabilities = dataclasses.replace(CPUBackend.capabilities, torch_process_group=False)

    with pytest.raises(ShardkitError, match="do not run on a torch process group.*'gloo'"):
        composed_class(CPUBackend, Own)


def test_an_unsupported_op_names_the_library_that_refuses_it():
    pair = get_backend("cpu+gloo")
    with pytest.raises(UnsupportedOperationError, match=r"^backend 'cpu' does not support reduce op 'avg'"):
        pair.collectives.torch_reduce_op("avg")


def test_the_pair_passes_the_conformance_suite():
    result = run_world("cpu+gloo", 2)
    assert result.failed_checks() == [], result.failures


def test_engine_on_a_pair_matches_the_one_process_run():
    results = shardkit.spawn(one_device_suite, 2, 2, backend="cpu+gloo", threads_per_rank=1)
    for r in results:
        assert r["backend"] == "cpu+gloo"
        worst = {name: (run["init_diff"], max(run["diffs"])) for name, run in r["runs"].items()}
        assert all(init == 0.0 and diff <= 1e-5 for init, diff in worst.values()), worst
        assert r["runs"]["cpu_offload"]["devices"] == ["cpu"]
        assert max(r["bf16"]) <= 1e-5
