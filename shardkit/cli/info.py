"""`shardkit info [--json]`: the parser; the report (which imports torch) is built in info_report."""

from __future__ import annotations

import argparse
import json


def main(as_json: bool = False, every_backend: bool = False) -> int:
    """Print the report (or JSON) and return the exit status."""
    from .info_report import collect, render

    facts = collect()
    print(json.dumps(facts, indent=2) if as_json else render(facts, every_backend))
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `shardkit info`: every registered backend, whether it runs here, and versions."""
    parser = subparsers.add_parser(
        "info", help="list registered backends, whether each runs here, and versions",
        description="List every registered backend: available or why not (with the install "
                    "hint), devices, process-group backend, capabilities; plus versions.")
    parser.add_argument("--json", action="store_true", help="print the same facts as JSON "
                        "(every backend's, capabilities included)")
    parser.add_argument("--all", action="store_true", dest="every_backend",
                        help="also the capabilities and versions of backends that cannot run here")
    parser.set_defaults(run=lambda args: main(as_json=args.json, every_backend=args.every_backend))
