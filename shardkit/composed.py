"""One backend's device side paired with another's collective side: ``backend="cuda+gloo"``.

A backend is two things a vendor ships together: a device (placement, streams, events, memory,
launching) and a collective library (process groups, reduce ops, what they average exactly).
Most jobs want the pair as shipped; some want to mix them: CUDA tensors through gloo (several
ranks on one GPU, where the GPU's own library refuses two ranks per device), CUDA with a third party's MPI
backend, a vendor's device with another library. ``"DEVICE+COLLECTIVES"`` names such a pair:
DEVICE is a registered backend, COLLECTIVES a registered backend or the collective library one
declares in ``Backend.collective_libraries`` (``gloo`` is the cpu backend's).

Every member of `Backend` belongs to exactly one side (DEVICE_SIDE, COLLECTIVE_SIDE below; a
test holds the two lists to the class), and the capabilities split the same way
(`composed_capabilities`): what collectives accept, average exactly, pad shards to and whether
they run on a torch process group come from the collective side; everything about memory,
streams and compilation from the device side. Whether several ranks may share one device is the
collective library's call: the cpu backend's (gloo) allows any number, so ``cuda+gloo`` runs as
many ranks as asked on one GPU; a collective side with a per-device limit keeps the device's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

from typing_extensions import override

from .backend import Backend
from .capabilities import Capabilities
from .errors import ShardkitError, UnsupportedOperationError

# Members answered by the device side's backend object.
DEVICE_SIDE = (
    "device_module", "normalize_device", "indexed_device", "local_device", "device_count",
    "set_device", "supports_dtype", "runs_fused_attention", "host_device", "new_stream", "current_stream",
    "use_stream", "new_event", "record_stream", "synchronize", "free_storage", "alloc_storage",
    "compiler_barrier", "step_boundary", "to_host", "snapshot_to_host", "memory_stats",
    "reset_peak_memory", "launch_env", "ddp_kwargs", "spawn_ranks", "launch_command",
)
# Members answered by the collective side's backend object.
COLLECTIVE_SIDE = (
    "process_group_backend", "process_group_options", "init_process_group", "world_group",
    "new_group", "destroy_group", "shutdown", "exact_reduce_ops_for", "torch_reduce_op",
    "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "broadcast", "barrier",
    "all_to_all_single", "fault_tolerant_process_group",
)
# Members the pair answers itself, from both sides.
PAIR_OWN = ("is_available", "unavailable_reason", "requirement_hint", "versions", "auto_select_now",
            "max_local_ranks")
# Capabilities fields that describe the collective library; the rest describe the device.
COLLECTIVE_FIELDS = ("async_collectives", "shard_alignment", "torch_process_group",
                     "collective_tensors_linger", "reduce_ops",
                     "exact_reduce_ops")


def composed_capabilities(device: Capabilities, collectives: Capabilities) -> Capabilities:
    """The device's capabilities with the collective library's fields, dtypes both handle, and the longer default timeout."""
    return dataclasses.replace(
        device, **{name: getattr(collectives, name) for name in COLLECTIVE_FIELDS},
        supported_dtypes=device.supported_dtypes & collectives.supported_dtypes,
        default_timeout=max(device.default_timeout, collectives.default_timeout))


def composed_name(device_cls: type[Backend], collectives_cls: type[Backend]) -> str:
    """The pair's canonical name: the device backend's name + the collective library's (or its backend's) name."""
    libraries = collectives_cls.collective_libraries
    return f"{device_cls.name}+{libraries[0] if libraries else collectives_cls.name}"


class ComposedBackend(Backend):
    """A backend whose device members come from `device` and whose collective members come from `collectives`.

    Each pair is its own class (`composed_class`), so its name and capabilities are class facts,
    as every backend's are: the planner and the conformance suite read them off the class.
    """

    device_class: ClassVar[type[Backend]]
    collectives_class: ClassVar[type[Backend]]

    def __init__(self, device: Backend | None = None, collectives: Backend | None = None) -> None:
        self.device = device if device is not None else self.device_class()
        self.collectives = collectives if collectives is not None else self.collectives_class()

    @override
    def __reduce__(self) -> tuple[Any, ...]:
        # The class is made at run time: a spawned rank rebuilds the pair from its two sides.
        return (compose, (self.device, self.collectives))

    @override
    @classmethod
    def is_available(cls) -> bool:
        """Both sides can run here."""
        return cls.device_class.is_available() and cls.collectives_class.is_available()

    @override
    @classmethod
    def unavailable_reason(cls) -> str:
        """The reason of the side that cannot run."""
        side = cls.device_class if not cls.device_class.is_available() else cls.collectives_class
        return f"its {side.name!r} side cannot run: {side.unavailable_reason()}"

    @override
    @classmethod
    def requirement_hint(cls) -> str:
        """What each side needs."""
        return f"{cls.device_class.requirement_hint()}; and {cls.collectives_class.requirement_hint()}"

    @override
    @classmethod
    def versions(cls) -> dict[str, str]:
        """Both sides' vendor package versions."""
        return {**cls.device_class.versions(), **cls.collectives_class.versions()}

    @override
    def max_local_ranks(self) -> int | None:
        """Unlimited where the collective library lets ranks share a device (gloo); else one per device."""
        if self.collectives.max_local_ranks() is None:
            return None
        return self.device.max_local_ranks()

    @override
    def __repr__(self) -> str:
        return (f"<shardkit backend {self.name!r}: {self.device.name!r} devices, "
                f"{self.collectives.name!r} collectives>")


def composed_class(device_cls: type[Backend], collectives_cls: type[Backend]) -> type[ComposedBackend]:
    """A backend class pairing `device_cls`'s devices with `collectives_cls`'s collectives (selection keeps one instance per pair)."""
    if not collectives_cls.capabilities.torch_process_group and (
            collectives_cls.device_type != device_cls.device_type):
        raise ShardkitError(
            f"backend {collectives_cls.name!r}'s collectives do not run on a torch process group, "
            f"so they move only its own {collectives_cls.device_type!r} tensors, not "
            f"{device_cls.name!r}'s {device_cls.device_type!r} tensors; pair {device_cls.name!r} "
            "with a torch.distributed library (e.g. 'gloo')")
    return type(f"{device_cls.__name__}With{collectives_cls.__name__}Collectives", (ComposedBackend,), {
        "__module__": __name__,
        "name": composed_name(device_cls, collectives_cls),
        "device_type": device_cls.device_type,
        "priority": device_cls.priority,
        "auto_select": False,
        "capabilities": composed_capabilities(device_cls.capabilities, collectives_cls.capabilities),
        "collective_libraries": collectives_cls.collective_libraries,
        "device_class": device_cls,
        "collectives_class": collectives_cls,
    })


def compose(device: Backend, collectives: Backend) -> ComposedBackend:
    """A backend running on `device`'s devices with `collectives`' collectives."""
    return composed_class(type(device), type(collectives))(device, collectives)


def _forward(side: str, member: str) -> Callable[..., Any]:
    def forwarded(self: ComposedBackend, *args: Any, **kwargs: Any) -> Any:
        return getattr(getattr(self, side), member)(*args, **kwargs)

    forwarded.__name__ = forwarded.__qualname__ = member
    forwarded.__doc__ = f"The {side} side's `{member}` (see Backend.{member})."
    return forwarded


def _forward_naming_the_pair(member: str) -> Callable[..., Any]:
    def forwarded(self: ComposedBackend, *args: Any, **kwargs: Any) -> Any:
        try:
            return getattr(self.collectives, member)(*args, **kwargs)
        except UnsupportedOperationError as exc:  # it names the collective side; the user chose the pair
            raise UnsupportedOperationError(f"{self.name}: {exc}") from None

    forwarded.__name__ = forwarded.__qualname__ = member
    forwarded.__doc__ = f"The collective side's `{member}` (see Backend.{member})."
    return forwarded


for _member in DEVICE_SIDE:
    setattr(ComposedBackend, _member, _forward("device", _member))
for _member in COLLECTIVE_SIDE:
    setattr(ComposedBackend, _member, _forward_naming_the_pair(_member))
del _member
