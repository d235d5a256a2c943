"""The `shardkit` command: `shardkit --version`, `shardkit info [--json]`, ...

Each subcommand lives in its own module with an ``add_parser(subparsers)`` function that adds its
parser(s) and sets ``run`` (a function of the parsed args returning an exit status). Adding one
is that module plus one entry in COMMANDS. Only the module of the command being run is imported,
so a broken or missing optional part (the demo's data, say) cannot take down the other commands.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from typing import Sequence

from .._version import __version__
from ..errors import ShardkitError
from ..suggest import did_you_mean
from .args import ENVIRONMENT_HELP
from .interrupts import note_ctrl_c
from .parser import SuggestingParser, subcommand_parser

# name -> (module whose add_parser registers it, one-line help shown by `shardkit --help`)
COMMANDS: dict[str, tuple[str, str]] = {
    "info": ("shardkit.cli.info",
             "list registered backends, whether each runs here, and versions"),
    "launch": ("shardkit.cli.launch", "start a script on N ranks (torchrun underneath)"),
    "consolidate": ("shardkit.checkpoint.cli",
                    "turn a sharded checkpoint into safetensors files (offline)"),
    "inspect": ("shardkit.checkpoint.cli", "print what a checkpoint holds"),
    "demo": ("shardkit.demo.cli", "train an MNIST-style CNN sharded across local processes"),
    "plan": ("shardkit.planner.cli",
             "predict per-rank memory and bytes per step of a model before launching"),
}


def _first_positional(argv: Sequence[str]) -> str | None:
    """The first token not starting with '-': the command the user named, known or not."""
    return next((token for token in argv if not token.startswith("-")), None)


VERBOSE_FLAGS = {"-v": 1, "-vv": 2, "-vvv": 3, "--verbose": 1}


def _take_verbosity(argv: list[str]) -> tuple[list[str], int]:
    """Pull -v / -vv / --verbose out of a command's own arguments (`shardkit demo -v` reads as
    `shardkit -v demo`); `launch` keeps them, as everything after its script is the script's."""
    command = _first_positional(argv)
    if command is None or command == "launch":
        return argv, 0
    at = argv.index(command)
    rest = [token for token in argv[at + 1:] if token not in VERBOSE_FLAGS]
    count = sum(VERBOSE_FLAGS.get(token, 0) for token in argv[at + 1:])
    return argv[:at + 1] + rest, count


def _apply_verbosity(count: int) -> None:
    """-v / -vv: SHARDKIT_LOG for this process and every rank it starts (they inherit the env)."""
    if count:
        from ..logs import configure_from_env

        os.environ["SHARDKIT_LOG"] = "info" if count == 1 else "debug"
        configure_from_env()


def _chosen_command(argv: Sequence[str]) -> str | None:
    """Return the subcommand named in `argv`, if it is one."""
    token = _first_positional(argv)
    return token if token in COMMANDS else None


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """Return the top-level parser: the full parser for the command in `argv`, a help stub for the rest."""
    parser = argparse.ArgumentParser(
        prog="shardkit", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="shardkit: one sharded data-parallel engine for PyTorch on every accelerator.",
        epilog=ENVIRONMENT_HELP)
    parser.add_argument("--version", action="version", version=f"shardkit {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="say what shardkit decides (SHARDKIT_LOG=info); -vv: every "
                             "collective too (debug); ranks it starts inherit it")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND",
                                       parser_class=SuggestingParser)
    chosen = _chosen_command(argv)
    if chosen is not None:
        importlib.import_module(COMMANDS[chosen][0]).add_parser(subparsers)
    for name, (_, help_line) in COMMANDS.items():
        if name not in subparsers.choices:
            subparsers.add_parser(name, help=help_line, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `shardkit` command line; return its exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    previous = signal.getsignal(signal.SIGINT)
    pressed = note_ctrl_c()
    try:
        return _run(argv)
    except BaseException as exc:
        # A Ctrl-C that lands inside a library's import (scikit-learn -> scipy -> numpy) can leave
        # that library half-imported and surface as another error (a RecursionError from numpy);
        # it is still the user's interrupt, and is answered as one.
        if not (isinstance(exc, KeyboardInterrupt) or pressed):
            raise
        # Ctrl-C reached every process of the terminal's group; spawn has stopped the ranks.
        print(f"\nshardkit {_first_positional(argv) or ''}: interrupted".replace(" :", ":"),
              file=sys.stderr)
        return 128 + 2
    finally:
        if pressed is not None and previous is not None:  # main() called in-process gives it back
            signal.signal(signal.SIGINT, previous)


def _run(argv: list[str]) -> int:
    named = _first_positional(argv)
    if named is not None and named not in COMMANDS:  # argparse's own error offers no guess
        print(f"shardkit: error: unknown command {named!r}{did_you_mean(named, COMMANDS)} "
              f"Commands: {', '.join(COMMANDS)} (shardkit --help)", file=sys.stderr)
        return 2
    argv, later_verbosity = _take_verbosity(argv)
    parser = build_parser(argv)
    args, extras = parser.parse_known_args(argv)
    if extras:
        command = subcommand_parser(parser, named) if named is not None else None
        if command is None:
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
        command.reject_extras(extras)
    if not hasattr(args, "run"):
        parser.print_help()
        return 0
    _apply_verbosity(args.verbose + later_verbosity)
    try:
        status = int(args.run(args) or 0)
        sys.stdout.flush()  # inside the try: a reader that left early shows up here
        return status
    except ShardkitError as exc:
        print(f"shardkit: error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # `shardkit info --json | head`: the reader has what it wanted. Point stdout at
        # /dev/null so the interpreter's final flush does not fail again, and exit as a
        # SIGPIPE'd command would.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + 13


if __name__ == "__main__":
    sys.exit(main())
