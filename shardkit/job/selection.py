"""Choose a backend: explicit name > SHARDKIT_BACKEND > site hook > best available by priority.

A name may pair two backends, "DEVICE+COLLECTIVES" (shardkit/composed.py): "cuda+gloo".
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from ..backend import Backend
from ..errors import BackendNotFoundError, BackendUnavailableError, ShardkitError
from ..suggest import did_you_mean
from ..logs import logger
from ..plugin.manager import plugin_state

_instances: dict[str, Backend] = {}
_lock = threading.Lock()


@dataclass(frozen=True)
class BackendStatus:
    """One registered backend as seen from this machine."""

    name: str
    available: bool
    reason: str  # empty when available
    hint: str
    priority: int
    plugin: str
    cls: type[Backend]


def _probe(cls: type[Backend]) -> tuple[bool, str]:
    try:
        if cls.is_available():
            return True, ""
        return False, cls.unavailable_reason()
    except Exception as exc:  # noqa: BLE001 - a probe must not take the process down
        return False, f"availability check raised {type(exc).__name__}: {exc}"


def _hint(cls: type[Backend]) -> str:
    try:
        return cls.requirement_hint()
    except Exception as exc:  # noqa: BLE001
        return f"(requirement_hint raised {type(exc).__name__}: {exc})"


def backend_statuses() -> list[BackendStatus]:
    """Return the status of every registered backend, highest priority first."""
    state = plugin_state()
    out = []
    for name, cls in state.registry.classes():
        ok, reason = _probe(cls)
        out.append(BackendStatus(name, ok, reason, _hint(cls), cls.priority,
                                 state.registry.origin(name), cls))
    return out


def describe_backends() -> str:
    """Return a few lines listing every registered backend, whether it runs here, and how to fix it."""
    lines = []
    for st in backend_statuses():
        if st.available:
            lines.append(f"  - {st.name}: available")
        else:
            lines.append(f"  - {st.name}: not available: {st.reason}. HINT: {st.hint}")
    for failure in plugin_state().failures.values():
        lines.append(f"  - plugin {failure.plugin!r} failed to load: {failure.error}")
    return "\n".join(lines) if lines else "  (no backends registered)"


def backend_class(name: str) -> type[Backend]:
    """The Backend class registered as `name` (or a "DEVICE+COLLECTIVES" pair's), whether or not
    it can run here (its declared capabilities are static facts: the planner plans a GPU job
    from a laptop with them)."""
    if "+" in name:
        from ..composed import composed_class

        device_name, collectives_name = _pair_names(name)
        try:
            return composed_class(backend_class(device_name),
                                  collective_side_class(collectives_name))
        except ShardkitError as exc:
            raise type(exc)(f"{name!r}: {exc}") from None
    state = plugin_state()
    cls = state.registry.get(name)
    if cls is None:
        if name in state.failures:
            raise state.failures[name].as_error()
        hint = _library_hint(name) or did_you_mean(name, [*state.registry.names(), *state.failures])
        raise BackendNotFoundError(f"unknown backend {name!r}{hint or '.'} Registered backends:\n"
                                   f"{describe_backends()}")
    return cls


def _library_hint(name: str) -> str:
    """A HINT for torch's name of a collective library given where a backend is meant ("gloo")."""
    registry = plugin_state().registry
    owners = sorted(cls.name for _, cls in registry.classes() if name in cls.collective_libraries)
    if not owners:
        return ""
    return (f": {name!r} is torch's name for a collective library; shardkit names a backend by "
            f"its device. HINT: backend={' or '.join(map(repr, owners))} runs on {name} (`shardkit info` "
            "lists the backends and what each needs).")


def collective_side_class(name: str) -> type[Backend]:
    """The registered backend whose collectives `name` means: a backend name, or a collective library one declares."""
    state = plugin_state()
    if name in state.registry:
        return backend_class(name)
    by_library = {lib: cls for _, cls in state.registry.classes() for lib in cls.collective_libraries}
    if name in by_library:
        return by_library[name]
    valid = [*state.registry.names(), *by_library]
    raise BackendNotFoundError(
        f"unknown collective side {name!r} in a 'DEVICE+COLLECTIVES' backend name"
        f"{did_you_mean(name, valid) or '.'} Valid collective sides: {', '.join(sorted(valid))} "
        "(a registered backend's name, or a collective library a backend declares)")


def _pair_names(spec: str) -> tuple[str, str]:
    """The two sides of a "DEVICE+COLLECTIVES" name."""
    device_name, _, collectives_name = (part.strip() for part in spec.partition("+"))
    if not device_name or not collectives_name or "+" in collectives_name:
        raise ShardkitError(f"backend {spec!r}: a pair is written 'DEVICE+COLLECTIVES' with one "
                            "'+', e.g. 'cuda+gloo' (CUDA tensors, gloo's collectives)")
    return device_name, collectives_name


def _composed_instance(spec: str) -> Backend:
    from ..composed import ComposedBackend, compose

    device_name, collectives_name = _pair_names(spec)
    try:
        device = _instance(device_name)
        collectives = _instance(collective_side_class(collectives_name).name)
    except ShardkitError as exc:
        raise type(exc)(f"{spec!r}: {exc}") from None
    pair = compose(device, collectives)
    with _lock:
        existing = _instances.get(pair.name)
        if (isinstance(existing, ComposedBackend) and existing.device_backend is device
                and existing.collective_backend is collectives):
            return existing
        _instances[pair.name] = pair
    logger.debug("backend %r: %r's devices with %r's collectives", pair.name, device.name,
                 collectives.name)
    return pair


def _instance(name: str) -> Backend:
    if "+" in name:
        return _composed_instance(name)
    state = plugin_state()
    cls = backend_class(name)
    ok, reason = _probe(cls)
    if not ok:
        raise BackendUnavailableError(f"backend {name!r} is not available: {reason}.\n"
                                      f"HINT: {_hint(cls)}\nRegistered backends:\n"
                                      f"{describe_backends()}")
    with _lock:
        if name not in _instances or type(_instances[name]) is not cls:
            _instances[name] = cls()
            logger.debug("backend %r: %s from plugin %r", name, cls.__qualname__,
                         state.registry.origin(name))
        return _instances[name]


def _auto_candidates() -> list[BackendStatus]:
    return [st for st in backend_statuses() if st.available and st.cls.auto_select_now()]


def get_backend(name: str | Backend | None = None) -> Backend:
    """Return the Backend to use: by name, from SHARDKIT_BACKEND, from a site hook, or the best available."""
    if isinstance(name, Backend):
        return name
    if name is not None:
        if not isinstance(name, str):
            raise ShardkitError(f"backend must be a name or a Backend, got {type(name).__name__}")
        return _instance(name)
    env_name = os.environ.get("SHARDKIT_BACKEND", "").strip()
    if env_name:
        try:
            return _instance(env_name)
        except ShardkitError as exc:
            raise type(exc)(f"SHARDKIT_BACKEND={env_name!r}: {exc}") from None
    state = plugin_state()
    candidates = _auto_candidates()
    chosen = state.pm.hook.shardkit_select_backend(
        available=[c.name for c in candidates], registered=state.registry.names())
    if chosen is not None:
        logger.debug("backend %r chosen by a plugin's shardkit_select_backend hook", chosen)
        return _instance(chosen)
    if not candidates:
        raise BackendUnavailableError("no backend can run here. Registered backends:\n"
                                      f"{describe_backends()}")
    logger.debug("backend %r chosen by priority among %s", candidates[0].name,
                 [c.name for c in candidates])
    return _instance(candidates[0].name)


def forget_backend_instances() -> None:
    """Drop cached Backend objects (tests that re-register plugins)."""
    with _lock:
        _instances.clear()
