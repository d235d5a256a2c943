"""The `shardkit` command: `shardkit --version`, `shardkit info [--json]`, ...

Adding a subcommand is one function that takes the subparsers object, adds a parser and sets
``run`` (a function of the parsed args returning an exit status), plus one entry in SUBCOMMANDS.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from .._version import __version__
from ..checkpoint.cli import add_parser as add_checkpoint_commands
from ..demo.cli import add_parser as add_demo
from ..errors import ShardkitError
from .launch import add_launch


def add_info(subparsers: argparse._SubParsersAction) -> None:
    """`shardkit info`: every registered backend, whether it runs here, and versions."""
    parser = subparsers.add_parser(
        "info", help="list registered backends, whether each runs here, and versions",
        description="List every registered backend: available or why not (with the install "
                    "hint), devices, process-group backend, capabilities; plus versions.")
    parser.add_argument("--json", action="store_true", help="print the same facts as JSON")

    def run(args: argparse.Namespace) -> int:
        from . import info

        return info.main(as_json=args.json)

    parser.set_defaults(run=run)


SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (add_info, add_launch,
                                                                      add_checkpoint_commands,
                                                                      add_demo)


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="shardkit",
        description="shardkit: one sharded data-parallel engine for PyTorch on every accelerator.")
    parser.add_argument("--version", action="version", version=f"shardkit {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `shardkit` command line; return its exit status."""
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    if not hasattr(args, "run"):
        parser.print_help()
        return 0
    try:
        return int(args.run(args) or 0)
    except ShardkitError as exc:
        print(f"shardkit: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
