"""Discover plugins through the ``shardkit`` entry-point group and build the backend registry.

A plugin that fails to import never breaks ``import shardkit``: the failure is kept, with its
traceback, and raised when somebody asks for that backend (or at once with
SHARDKIT_STRICT_PLUGINS=1).
"""

from __future__ import annotations

import importlib
import os
import threading
import traceback
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

import pluggy

from ..env_flags import PLUGIN_AUTOLOAD, STRICT_PLUGINS, env_flag
from ..errors import PluginLoadError
from . import spec
from .registry import BackendRegistry

ENTRY_POINT_GROUP = "shardkit"
# Used only when shardkit runs from a source tree without installed metadata.
BUILTIN_PLUGINS = {
    "cpu": "shardkit_backends.cpu",
    "cuda": "shardkit_backends.cuda",
    "xpu": "shardkit_backends.xpu",
    "xla": "shardkit_backends.xla",
}


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that could not be loaded or could not register its backends."""

    plugin: str
    target: str
    error: str
    traceback: str

    def as_error(self) -> PluginLoadError:
        """Return the PluginLoadError to raise, original traceback included."""
        return PluginLoadError(f"plugin {self.plugin!r} ({self.target}) failed to load: "
                               f"{self.error}\n--- original traceback ---\n{self.traceback}")


class PluginState:
    """The loaded plugin manager, the registry it filled, and the plugins that failed."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(spec.PROJECT_NAME)
        self.pm.add_hookspecs(spec)
        self.registry = BackendRegistry()
        self.failures: dict[str, PluginFailure] = {}
        self.plugin_names: list[str] = []

    def register(self, plugin: Any, name: str, target: str) -> None:
        """Register one plugin object and let it add its backends; record any failure."""
        strict = env_flag(STRICT_PLUGINS)
        try:
            self.pm.register(plugin, name=name)
            try:
                # A hookimpl named like no hookspec (`shardkit_register_backend`, say) would
                # otherwise be ignored without a word.
                self.pm.check_pending()
            except pluggy.PluginValidationError as exc:
                hooks = ", ".join(sorted(n for n in dir(spec) if n.startswith("shardkit_")))
                raise PluginLoadError(f"{exc}. HINT: shardkit's hooks are {hooks}") from None
            self.registry.current_plugin = name
            impls = [i for i in self.pm.hook.shardkit_register_backends.get_hookimpls()
                     if i.plugin_name == name]
            for impl in impls:
                impl.function(registry=self.registry)
            self.plugin_names.append(name)
        except Exception as exc:  # noqa: BLE001 - a broken plugin must not break shardkit
            self._fail(name, target, exc, strict)

    def load_entry_point(self, name: str, target: str, loader: Any) -> None:
        """Import one entry point's object and register it."""
        strict = env_flag(STRICT_PLUGINS)
        try:
            plugin = loader()
        except Exception as exc:  # noqa: BLE001
            self._fail(name, target, exc, strict)
            return
        self.register(plugin, name, target)

    def _fail(self, name: str, target: str, exc: BaseException, strict: bool) -> None:
        if self.pm.has_plugin(name):
            self.pm.unregister(name=name)
        self.registry.remove_plugin(name)
        failure = PluginFailure(name, target, f"{type(exc).__name__}: {exc}",
                                "".join(traceback.format_exception(exc)))
        self.failures[name] = failure
        if strict:
            raise failure.as_error() from exc


_lock = threading.Lock()
_state: PluginState | None = None


def _disabled() -> set[str]:
    return {n.strip() for n in os.environ.get("SHARDKIT_DISABLED_PLUGINS", "").split(",") if n.strip()}


def _discover() -> PluginState:
    state = PluginState()
    disabled = _disabled()
    seen: set[str] = set()
    autoload = env_flag(PLUGIN_AUTOLOAD, default=True)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in seen:
            continue  # the same distribution visible twice on sys.path
        seen.add(ep.name)
        if ep.name in disabled or (not autoload and ep.name not in BUILTIN_PLUGINS):
            continue
        state.load_entry_point(ep.name, ep.value, ep.load)
    for name, module in BUILTIN_PLUGINS.items():
        if name not in seen and name not in disabled:
            state.load_entry_point(name, module, lambda m=module: importlib.import_module(m))
    return state


def plugin_state() -> PluginState:
    """Return the process-wide plugin state, discovering plugins on first use."""
    global _state
    with _lock:
        if _state is None:
            _state = _discover()
        return _state


def register_plugin(plugin: Any, name: str | None = None) -> None:
    """Register a plugin object (module or instance with hookimpls) without an entry point."""
    state = plugin_state()
    label = name or str(getattr(plugin, "__name__", type(plugin).__name__))
    state.register(plugin, label, label)


def reset_plugins() -> None:
    """Let every loaded plugin drop its process-global state, then forget them all (next lookup rediscovers)."""
    global _state
    with _lock:
        state, _state = _state, None
    if state is not None:
        state.pm.hook.shardkit_reset_state()
