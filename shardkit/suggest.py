""""Did you mean ...?" for the names users type: backends, strategies, commands."""

from __future__ import annotations

import difflib
from typing import Iterable


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The one of `choices` closest to `word` (any case), or None when none is close."""
    by_lower = {choice.lower(): choice for choice in choices}
    close = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=0.6)
    return by_lower[close[0]] if close else None


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """Return "; did you mean 'x'?" for the closest of `choices` to `word` (any case), or ""."""
    guess = closest(word, choices)
    return f"; did you mean {guess!r}?" if guess else ""
