"""Where this rank is in the engine (unit and phase), recorded cheaply for failure reports."""

from __future__ import annotations

# A plain module-level list, not a thread-local: the watchdog thread reads what the training
# thread wrote. Two slots assigned per unit per phase cost a few nanoseconds.
_where: list = [None, None]


def enter(unit: str | None, phase: str | None) -> None:
    """Record that this rank is now running `unit` (a unit name, or None) in `phase`."""
    _where[0] = unit
    _where[1] = phase


def current() -> tuple[str | None, str | None]:
    """Return the (unit, phase) recorded last."""
    return _where[0], _where[1]


def describe() -> str:
    """Say in words where this rank was, for an error message."""
    unit, phase = _where
    if phase is None:
        return "no sharded unit had run yet"
    if unit is None:
        return phase
    return f"unit {unit!r}, {phase}"


def reset() -> None:
    """Forget the recorded place (a new job starts)."""
    enter(None, None)
