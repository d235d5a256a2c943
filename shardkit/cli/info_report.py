"""What `shardkit info` reports: every registered backend, whether it runs here, and versions."""

from __future__ import annotations

import os
import platform
import textwrap
from importlib.metadata import entry_points
from typing import Any, Callable

import pluggy
import torch

from .._version import __version__
from ..errors import ShardkitError
from ..plugin.manager import ENTRY_POINT_GROUP, plugin_state
from ..job.selection import BackendStatus, backend_statuses, get_backend

WIDTH = 100


def _call(fn: Callable[[], Any], errors: dict[str, str], label: str) -> Any:
    """Call a plugin's method; a failure is recorded under `label` and gives None, never a crash."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - `info` must describe broken plugins, not die on them
        errors[label] = f"{type(exc).__name__}: {exc}"
        return None


def _entry_point_origins() -> dict[str, dict[str, str]]:
    """Map entry-point name to the distribution (and version) that declares it."""
    out: dict[str, dict[str, str]] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        out.setdefault(ep.name, {"distribution": dist.name if dist else "?",
                                 "distribution_version": dist.version if dist else "?",
                                 "entry_point": ep.value})
    return out


def _backend_facts(st: BackendStatus, origins: dict[str, dict[str, str]]) -> dict[str, Any]:
    """Everything `info` reports about one registered backend."""
    errors: dict[str, str] = {}
    # By name, so a wrong SHARDKIT_BACKEND cannot stop the others from being listed.
    instance = _call(lambda: get_backend(st.name) if st.available else st.cls(), errors, "constructor")
    origin = origins.get(st.plugin, {"distribution": None, "distribution_version": None,
                                     "entry_point": None})
    return {
        "name": st.name,
        "available": st.available,
        "reason": st.reason or None,
        "hint": None if st.available else st.hint,
        "device_count": (_call(instance.devices.device_count, errors, "device_count()")
                         if st.available and instance is not None else None),
        "process_group_backend": (_call(instance.collectives.process_group_backend, errors,
                                        "process_group_backend()") if instance is not None else None),
        "priority": st.priority,
        "auto_select": _call(st.cls.auto_select_now, errors, "auto_select_now()") is True,
        "plugin": st.plugin,
        **origin,
        "device_type": st.cls.device_type,
        "capabilities": st.cls.capabilities.describe(),
        "versions": _call(st.cls.versions, errors, "versions()") or {},
        "errors": errors,
    }


def collect() -> dict[str, Any]:
    """Return every fact `shardkit info` shows, JSON-ready."""
    state = plugin_state()
    origins = _entry_point_origins()
    try:
        default, default_error = get_backend().name, None
    except ShardkitError as exc:
        # Its first line, without the list of backends that the table below shows in full.
        default, default_error = None, str(exc).splitlines()[0].split(" Registered backends:")[0]
    return {
        "shardkit": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pluggy": pluggy.__version__,
        "platform": platform.platform(),
        "default_backend": default,
        "default_backend_error": default_error,
        "backends": [_backend_facts(st, origins) for st in backend_statuses()],
        "failed_plugins": [{"plugin": f.plugin, "target": f.target, "error": f.error,
                            "traceback": f.traceback} for f in state.failures.values()],
        "settings": {k: v for k, v in sorted(os.environ.items()) if k.startswith("SHARDKIT_")},
    }


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _table(rows: list[list[str]]) -> list[str]:
    """Left-aligned columns two spaces apart."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def _wrapped(label: str, text: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=f"    {label}: ",
                         subsequent_indent=" " * (len(label) + 6), break_long_words=False,
                         break_on_hyphens=False)


def _capability_text(caps: dict[str, Any]) -> str:
    flags = [f"{k}={_yes(v) if isinstance(v, bool) else v}" for k, v in caps.items()
             if not isinstance(v, list)]
    return (" ".join(flags) + f"; reduce ops: {', '.join(caps['reduce_ops'])}"
            f"; exact averaging ops: {', '.join(caps['exact_reduce_ops']) or 'none (sum + divide)'}"
            f"; dtypes: {', '.join(caps['supported_dtypes'])}")


def _plugin_text(b: dict[str, Any]) -> str:
    if b["distribution"] is None:
        return f"{b['plugin']} (registered in code)"
    return f"{b['plugin']} ({b['distribution']} {b['distribution_version']})"


def render(facts: dict[str, Any], every_backend: bool = False) -> str:
    """Return the human-readable report for `facts` (as made by collect()).

    Capabilities and versions are shown for the backends that run here; those that cannot get
    their reason and install hint only, unless `every_backend` (`shardkit info --all`).
    """
    lines = [f"shardkit {facts['shardkit']}  |  python {facts['python']}  |  torch {facts['torch']}"
             f"  |  pluggy {facts['pluggy']}", f"platform: {facts['platform']}", ""]
    rows = [["BACKEND", "AVAILABLE", "DEVICES", "PROCESS GROUP", "PRIORITY", "AUTO-SELECT", "PLUGIN"]]
    for b in facts["backends"]:
        rows.append([b["name"], _yes(b["available"]),
                     "-" if b["device_count"] is None else str(b["device_count"]),
                     b["process_group_backend"] or "?", str(b["priority"]), _yes(b["auto_select"]),
                     _plugin_text(b)])
    lines += _table(rows) if facts["backends"] else ["(no backends registered)"]
    if facts["default_backend"]:
        lines += ["", f"default backend here: {facts['default_backend']}"]
    else:
        lines += ["", f"default backend here: none ({facts['default_backend_error']})"]
    for b in facts["backends"]:
        lines.append("")
        if b["available"]:
            lines.append(f"{b['name']}: available, {b['device_count']} device(s) "
                         f"of type {b['device_type']!r}")
        else:
            lines.append(f"{b['name']}: not available: {b['reason']}")
            lines += _wrapped("HINT", b["hint"])
            if not every_backend:
                continue
        lines += _wrapped("capabilities", _capability_text(b["capabilities"]))
        versions = ", ".join(f"{k} {v}" for k, v in b["versions"].items())
        lines += _wrapped("versions", versions or "(none reported)")
        for call, error in b["errors"].items():
            lines += _wrapped(f"{call} raised", error.splitlines()[0])
    if facts["failed_plugins"]:
        lines += ["", "Plugins that failed to load (selecting their backend shows the traceback):"]
        for f in facts["failed_plugins"]:
            lines.append(f"  {f['plugin']} ({f['target']}): {f['error']}")
            lines += _wrapped("HINT", f"fix or uninstall the plugin, or skip it with "
                                      f"SHARDKIT_DISABLED_PLUGINS={f['plugin']}")
    hidden = [b["name"] for b in facts["backends"] if not b["available"]]
    if hidden and not every_backend:
        lines += ["", f"(capabilities of {', '.join(hidden)}: shardkit info --all)"]
    if facts["settings"]:
        lines += ["", "settings: " + " ".join(f"{k}={v}" for k, v in facts["settings"].items())]
    return "\n".join(lines)
