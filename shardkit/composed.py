"""One backend's device side paired with another's collective side: ``backend="cuda+gloo"``.

A backend is two things a vendor ships together: a device (placement, streams, events, memory,
launching) and a collective library (process groups, reduce ops, what they average exactly).
Most jobs want the pair as shipped; some want to mix them: CUDA tensors through gloo (several
ranks on one GPU, where the GPU's own library refuses two ranks per device), CUDA with a third party's MPI
backend, a vendor's device with another library. ``"DEVICE+COLLECTIVES"`` names such a pair:
DEVICE is a registered backend, COLLECTIVES a registered backend or the collective library one
declares in ``Backend.collective_libraries`` (``gloo`` is the cpu backend's).

A backend is made of its two sides (backend.py: `DeviceSide`, `CollectiveSide`) and the engine
reaches each through `backend.devices` / `backend.collectives`, so a pair is a backend whose
`devices` is one backend and whose `collectives` is another: the engine forwards nothing. (A
user's script that calls a side member on the pair itself, `ctx.backend.all_reduce(...)`, is
answered by that side.) The capabilities split the same way (`composed_capabilities`): what
collectives accept, average exactly, pad shards to and whether they run on a torch process
group come from the collective side; everything about memory, streams and compilation from the
device side. Whether several ranks may share one device is the collective library's call: the
cpu backend's (gloo) allows any number, so ``cuda+gloo`` runs as many ranks as asked on one GPU;
a collective side with a per-device limit keeps the device's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar

from typing_extensions import override

from .backend import Backend, CollectiveSide, DeviceSide, side_members
from .capabilities import Capabilities
from .errors import ShardkitError

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
    """A backend whose `devices` is one backend and whose `collectives` is another's.

    Each pair is its own class (`composed_class`), so its name and capabilities are class facts,
    as every backend's are: the planner and the conformance suite read them off the class.
    """

    device_class: ClassVar[type[Backend]]
    collectives_class: ClassVar[type[Backend]]

    def __init__(self, device: Backend | None = None, collectives: Backend | None = None) -> None:
        self.device_backend = device if device is not None else self.device_class()
        self.collective_backend = collectives if collectives is not None else self.collectives_class()

    @property
    @override
    def devices(self) -> DeviceSide:
        """The device backend (its device side)."""
        return self.device_backend

    @property
    @override
    def collectives(self) -> CollectiveSide:
        """The collective backend (its collective side)."""
        return self.collective_backend

    @override
    def __reduce__(self) -> tuple[Any, ...]:
        # The class is made at run time: a spawned rank rebuilds the pair from its two sides.
        return (compose, (self.device_backend, self.collective_backend))

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
        if self.collective_backend.max_local_ranks() is None:
            return None
        return self.device_backend.max_local_ranks()

    @override
    def __repr__(self) -> str:
        return (f"<shardkit backend {self.name!r}: {self.device_backend.name!r} devices, "
                f"{self.collective_backend.name!r} collectives>")


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


def _answered_by(side: str, member: str) -> Callable[..., Any]:
    def answered(self: ComposedBackend, *args: Any, **kwargs: Any) -> Any:
        return getattr(getattr(self, side), member)(*args, **kwargs)

    answered.__name__ = answered.__qualname__ = member
    answered.__doc__ = f"`backend.{side}.{member}` (see {side.title().rstrip('s')}Side.{member})."
    return answered


# The engine never calls these on a pair (tests/test_lint_backend_sides.py); a user's script written
# against one backend (`ctx.backend.all_reduce(...)`) does, and gets the side's own member, not the
# inherited default. Made from the side types, so a member added to a side is answered with no edit.
for _side, _members in (("devices", side_members(DeviceSide)), ("collectives", side_members(CollectiveSide))):
    for _member in _members:
        setattr(ComposedBackend, _member, _answered_by(_side, _member))
del _side, _members, _member
