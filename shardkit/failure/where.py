"""Where this rank is in the engine (unit and phase), recorded cheaply for failure reports."""

from __future__ import annotations

# A plain module-level list, not a thread-local: the watchdog thread reads what the training
# thread wrote. Two slots assigned per unit per phase cost a few nanoseconds.
_where: list = [None, None]
# Units whose forward has started and not finished, innermost last: when one finishes, the rank
# is back in the unit around it (or past the model's forward), not still in the one that ended.
_forward_stack: list = []
AFTER_FORWARD = "after the model's forward (the loss, or your code before backward)"


def enter(unit: str | None, phase: str | None) -> None:
    """Record that this rank is now running `unit` (a unit name, or None) in `phase`."""
    _where[0] = unit
    _where[1] = phase


def forward_started(unit: str, outermost: bool) -> None:
    """Record that `unit`'s forward started (`outermost`: the model's root unit, a new forward)."""
    if outermost:
        _forward_stack.clear()
    _forward_stack.append(unit)
    enter(unit, "forward")


def forward_finished(unit: str) -> None:
    """Record that `unit`'s forward returned: the rank is in the enclosing unit again, or past the model."""
    while _forward_stack and _forward_stack.pop() != unit:
        pass  # forwards nest: `unit` is the innermost (anything above it never finished)
    if _where[1] != "forward":
        return  # a recompute inside backward (activation checkpointing): backward says where
    if _forward_stack:
        enter(_forward_stack[-1], "forward")
    else:
        enter(None, AFTER_FORWARD)


def current() -> tuple[str | None, str | None]:
    """Return the (unit, phase) recorded last."""
    return _where[0], _where[1]


def describe() -> str:
    """Say in words where this rank was, for an error message."""
    unit, phase = _where
    if phase is None:
        return "setup, before any sharded unit ran"
    if unit is None:
        return phase
    return f"unit {unit!r}, {phase}"


def reset() -> None:
    """Forget the recorded place (a new job starts)."""
    _forward_stack.clear()
    enter(None, None)
