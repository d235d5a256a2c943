"""The registry object handed to ``shardkit_register_backends``: names to Backend classes."""

from __future__ import annotations

from ..backend import API_VERSION, Backend, CollectiveSide, DeviceSide
from ..errors import ShardkitError

_REQUIRED = ("is_available", "requirement_hint", "local_device", "device_count",
             "process_group_backend")
# Where the required members are declared but not written (raise NotImplementedError).
_DECLARED_ONLY = (Backend, DeviceSide, CollectiveSide)


def _defined_by(cls: type, member: str) -> type | None:
    """Return the class in `cls`'s MRO that defines `member` (getattr would bind classmethods anew)."""
    return next((klass for klass in cls.__mro__ if member in vars(klass)), None)


class BackendRegistry:
    """Holds the Backend classes that plugins registered, keyed by backend name."""

    def __init__(self) -> None:
        self._classes: dict[str, type[Backend]] = {}
        self._origin: dict[str, str] = {}
        self.current_plugin = "<unknown>"  # set by the manager while a plugin's hook runs

    def add(self, cls: type[Backend]) -> type[Backend]:
        """Register a Backend subclass; returns it so this also works as a class decorator."""
        if not (isinstance(cls, type) and issubclass(cls, Backend)):
            raise ShardkitError(f"plugin {self.current_plugin!r} registered {cls!r}, "
                                "which is not a subclass of shardkit.Backend")
        name = getattr(cls, "name", None)
        if not isinstance(name, str) or not name.isidentifier():
            raise ShardkitError(f"{cls.__qualname__} (plugin {self.current_plugin!r}) needs a class "
                                f"attribute `name` that is an identifier, got {name!r}")
        if not isinstance(getattr(cls, "device_type", None), str):
            raise ShardkitError(f"{cls.__qualname__} (plugin {self.current_plugin!r}) needs a class "
                                "attribute `device_type`, a torch device type string")
        missing = [m for m in _REQUIRED if _defined_by(cls, m) in _DECLARED_ONLY]
        if missing:
            raise ShardkitError(f"{cls.__qualname__} (plugin {self.current_plugin!r}) does not "
                                f"implement the required member(s) {missing}")
        if cls.requires_api > API_VERSION:
            raise ShardkitError(f"backend {name!r} needs shardkit backend API {cls.requires_api}, "
                                f"this shardkit provides {API_VERSION}; upgrade shardkit")
        if name in self._classes and self._classes[name] is not cls:
            raise ShardkitError(f"backend name {name!r} is registered twice: by plugin "
                                f"{self._origin[name]!r} and by plugin {self.current_plugin!r}; "
                                "disable one with SHARDKIT_DISABLED_PLUGINS")
        self._classes[name] = cls
        self._origin[name] = self.current_plugin
        return cls

    def remove_plugin(self, plugin: str) -> None:
        """Drop every backend a plugin registered (used when its registration failed midway)."""
        for name in [n for n, origin in self._origin.items() if origin == plugin]:
            del self._classes[name], self._origin[name]

    def names(self) -> list[str]:
        """Return registered backend names, highest priority first."""
        return sorted(self._classes, key=lambda n: (-self._classes[n].priority, n))

    def classes(self) -> list[tuple[str, type[Backend]]]:
        """Return (name, class) for every registered backend, highest priority first."""
        return [(name, self._classes[name]) for name in self.names()]

    def get(self, name: str) -> type[Backend] | None:
        """Return the class registered under `name`, or None."""
        return self._classes.get(name)

    def origin(self, name: str) -> str:
        """Return the plugin that registered `name`."""
        return self._origin[name]

    def __contains__(self, name: object) -> bool:
        return name in self._classes

    def __len__(self) -> int:
        return len(self._classes)
