"""Small value types shared by backends and the engine: groups, work handles, null streams."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


class ReduceOp:
    """Names of the reduce ops a collective may take.

    AVG and PREMUL_SUM (a sum of inputs each scaled by a factor) are only for backends that list
    them in Capabilities.exact_reduce_ops: they are missing or silently wrong on several stacks.
    """

    SUM = "sum"
    MAX = "max"
    MIN = "min"
    AVG = "avg"
    PREMUL_SUM = "premul_sum"
    ALL = frozenset({SUM, MAX, MIN})


class Work(Protocol):
    """What every collective returns: something to wait on."""

    def wait(self) -> Any:
        """Block until the collective's result is visible to later work."""

    def is_completed(self) -> bool:
        """Return True once waiting would not block."""


class CompletedWork:
    """A Work for an operation that finished before it was returned."""

    def wait(self) -> bool:
        """Return at once: the result is already there."""
        return True

    def is_completed(self) -> bool:
        """Always True."""
        return True


class TorchWork:
    """Adapts torch.distributed's Work (or None, for a synchronous call) to `Work`."""

    __slots__ = ("_work", "_done")

    def __init__(self, work: Any) -> None:
        self._work = work
        self._done = work is None

    def wait(self) -> bool:
        """Wait on the underlying torch Work once."""
        if not self._done:
            self._work.wait()
            self._done = True
        return True

    def is_completed(self) -> bool:
        """Ask the underlying Work whether it has finished."""
        return self._done or bool(self._work.is_completed())


class ComposedWork:
    """One collective a backend built from several: waits on each part, then runs `finish` once.

    `finish` completes the result on the caller's side (a copy out of a scratch buffer), so it
    runs on the first wait(), or on the first is_completed() that finds every part done.
    """

    __slots__ = ("_parts", "_finish", "_done")

    def __init__(self, parts: list[Any], finish: Any = None) -> None:
        self._parts = parts
        self._finish = finish
        self._done = False

    def wait(self) -> bool:
        """Wait on every part, then finish."""
        if not self._done:
            for part in self._parts:
                part.wait()
            self._complete()
        return True

    def is_completed(self) -> bool:
        """True once every part finished (finishing the result then, if not yet done)."""
        if not self._done and all(part.is_completed() for part in self._parts):
            self._complete()
        return self._done

    def _complete(self) -> None:
        if self._finish is not None:
            self._finish()
        self._done = True


@dataclass(frozen=True)
class Group:
    """A set of ranks that run collectives together, as seen from one rank."""

    rank: int  # this rank's index inside the group, -1 when not a member
    size: int
    ranks: tuple[int, ...]  # global ranks, in group order
    handle: Any = field(default=None, compare=False, repr=False)  # the backend's own object

    @property
    def is_member(self) -> bool:
        """True when the calling rank belongs to this group."""
        return self.rank >= 0


class NullEvent:
    """An event for devices without streams: everything is already ordered."""

    def record(self, stream: Any = None) -> None:
        """Nothing to record: work on such devices is ordered already."""

    def wait(self, stream: Any = None) -> None:
        """Nothing to wait for."""

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        """Always complete."""
        return True


class NullStream:
    """A stream for devices without streams; usable wherever a real stream is."""

    def wait_stream(self, other: Any) -> None:
        """No ordering to add."""

    def wait_event(self, event: Any) -> None:
        """No ordering to add."""

    def record_event(self, event: Any = None) -> NullEvent:
        """Return an event that is already complete."""
        return event if event is not None else NullEvent()

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        """Always idle."""
        return True

    def __enter__(self) -> "NullStream":
        return self

    def __exit__(self, *exc: object) -> None:
        return None
