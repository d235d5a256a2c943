"""shardkit's logger and the SHARDKIT_LOG switch that prints it.

Every module logs under the ``"shardkit"`` logger (``logging.getLogger("shardkit")``): INFO says
which backend and process group a rank joined and how a model was sharded (strategy, units and
their sizes); DEBUG adds how each backend was chosen and one line per collective. An application
configures that logger like any other; ``SHARDKIT_LOG=debug`` (or ``info``) is the shortcut that
sends it to stderr without touching Python's logging setup.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Mapping

LOGGER_NAME = "shardkit"
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR}
FORMAT = "[shardkit %(levelname)s pid %(process)d] %(message)s"

logger = logging.getLogger(LOGGER_NAME)


class _EnvHandler(logging.StreamHandler):
    """The stderr handler SHARDKIT_LOG adds (a class of its own so it is added only once)."""


def configure_from_env(environ: Mapping[str, str] | None = None) -> None:
    """Apply SHARDKIT_LOG=debug|info|warning|error: that level and a stderr handler on the "shardkit" logger."""
    value = (os.environ if environ is None else environ).get("SHARDKIT_LOG", "").strip().lower()
    if not value:
        return
    if value not in LEVELS:
        print(f"shardkit: SHARDKIT_LOG={value!r} ignored; use one of {', '.join(LEVELS)}",
              file=sys.stderr)
        return
    logger.setLevel(LEVELS[value])
    if not any(isinstance(h, _EnvHandler) for h in logger.handlers):
        handler = _EnvHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(FORMAT))
        logger.addHandler(handler)
