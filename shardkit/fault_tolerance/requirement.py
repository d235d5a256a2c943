"""Import torchft, or raise saying which extra installs it."""

from __future__ import annotations

from types import ModuleType

from ..errors import ShardkitError
from ..install_hint import pip_install_extra

TESTED_VERSION = "0.2.0"


def require_torchft() -> ModuleType:
    """The torchft module; a ShardkitError with the install line when it is missing."""
    try:
        import torchft
    except ImportError as exc:
        raise ShardkitError(
            f"fault tolerance across replica groups runs on torchft, which is not installed "
            f"({exc}).\nHINT: {pip_install_extra('ft')}  (torchft=={TESTED_VERSION})") from None
    return torchft
