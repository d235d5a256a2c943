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
import sys
from typing import Sequence

from .._version import __version__
from ..errors import ShardkitError
from ..suggest import did_you_mean

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


def _chosen_command(argv: Sequence[str]) -> str | None:
    """Return the subcommand named in `argv`, if it is one."""
    token = _first_positional(argv)
    return token if token in COMMANDS else None


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """Return the top-level parser: the full parser for the command in `argv`, a help stub for the rest."""
    parser = argparse.ArgumentParser(
        prog="shardkit",
        description="shardkit: one sharded data-parallel engine for PyTorch on every accelerator.")
    parser.add_argument("--version", action="version", version=f"shardkit {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
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
    named = _first_positional(argv)
    if named is not None and named not in COMMANDS:  # argparse's own error offers no guess
        print(f"shardkit: error: unknown command {named!r}{did_you_mean(named, COMMANDS)} "
              f"Commands: {', '.join(COMMANDS)} (shardkit --help)", file=sys.stderr)
        return 2
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 0
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
