"""On/off switches read from the environment (SHARDKIT_DEBUG, SHARDKIT_WATCHDOG, ...), read alike."""

from __future__ import annotations

import os

_OFF = ("0", "false", "no", "off")


def env_flag(name: str, default: bool = False) -> bool:
    """True when variable `name` is set to anything but 0/false/no/off; `default` if unset or empty."""
    value = os.environ.get(name, "")
    if not value.strip():
        return default
    return value.strip().lower() not in _OFF
