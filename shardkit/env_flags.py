"""On/off switches read from the environment, by one parser, where they are used.

Every boolean setting shardkit reads (SHARDKIT_DEBUG, SHARDKIT_WATCHDOG, SHARDKIT_STRICT_PLUGINS,
SHARDKIT_PLUGIN_AUTOLOAD, SHARDKIT_LOCAL_STEP) is named here once and parsed by `env_flag`, at the moment it matters
(not at import), so `SHARDKIT_STRICT_PLUGINS=on` means on everywhere and a value that is neither
on nor off (`SHARDKIT_WATCHDOG=disable`) is refused, naming the variable, instead of being read
as one or the other.
"""

from __future__ import annotations

import os

from .errors import ShardkitError

DEBUG = "SHARDKIT_DEBUG"  # verify collective order, full tracebacks of failed collectives
WATCHDOG = "SHARDKIT_WATCHDOG"  # the per-rank failure watchdog (on by default)
STRICT_PLUGINS = "SHARDKIT_STRICT_PLUGINS"  # a plugin's import error raises at discovery
PLUGIN_AUTOLOAD = "SHARDKIT_PLUGIN_AUTOLOAD"  # load third-party plugins' entry points (on by default)
LOCAL_STEP = "SHARDKIT_LOCAL_STEP"  # elementwise optimizers step DTensors' local tensors (on by default)

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def env_flag(name: str, default: bool = False) -> bool:
    """True for 1/true/yes/on, False for 0/false/no/off (any case); `default` if unset or empty."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if not value:
        return default
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ShardkitError(f"{name}={raw!r} is neither on nor off: set it to one of "
                        f"{', '.join(_ON)} (on) or {', '.join(_OFF)} (off), or unset it "
                        f"(default: {'on' if default else 'off'})")
