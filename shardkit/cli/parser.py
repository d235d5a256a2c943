"""The `shardkit` commands' argument parser: argparse's, plus "did you mean" for a mistyped flag or choice.

argparse names an unknown flag under the top-level usage (`shardkit [-h] ... COMMAND`), since the
subcommand's parser leaves extras to its parent, and lists a choice's valid values without saying
which one was meant. Both errors are answered here by the command the user ran, with its usage.
"""

from __future__ import annotations

import argparse
import re
from typing import NoReturn, Sequence

from typing_extensions import override

from ..suggest import closest, did_you_mean

_INVALID_CHOICE = re.compile(r"invalid choice: '(?P<word>[^']*)' \(choose from (?P<choices>.*)\)")


class SuggestingParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors add the closest valid choice or flag."""

    @override
    def error(self, message: str) -> NoReturn:
        """Print usage and the error, with a guess at what was meant, and exit 2."""
        found = _INVALID_CHOICE.search(message)
        if found:
            choices = re.findall(r"'([^']*)'", found.group("choices"))
            message += did_you_mean(found.group("word"), choices)
        super().error(message)

    def flag_names(self) -> list[str]:
        """Every option string this parser accepts (--model, -h, ...)."""
        return [name for action in self._actions for name in action.option_strings]

    def reject_extras(self, extras: Sequence[str]) -> NoReturn:
        """Refuse arguments this command does not take, naming the closest flag for each."""
        parts = []
        for token in extras:
            flag = token.split("=", 1)[0]
            guess = closest(flag, self.flag_names()) if flag.startswith("-") else None
            parts.append(f"{token!r} (did you mean {guess!r}?)" if guess else repr(token))
        self.error(f"unrecognized argument{'s' if len(parts) > 1 else ''}: {', '.join(parts)}")


def subcommand_parser(parser: argparse.ArgumentParser, name: str) -> SuggestingParser | None:
    """The parser `build_parser` registered for command `name`, if it is a SuggestingParser."""
    for action in parser._actions:  # argparse keeps subparsers only on this action
        if isinstance(action, argparse._SubParsersAction):
            found = action.choices.get(name)
            return found if isinstance(found, SuggestingParser) else None
    return None
