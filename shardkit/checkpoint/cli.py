"""`shardkit consolidate CKPT_DIR OUT` and `shardkit inspect CKPT_DIR`: offline, no process group."""

from __future__ import annotations

import argparse
import json

# safetensors_io.DEFAULT_MAX_SHARD_SIZE, spelled out so that parsing needs no torch (tested equal).
MAX_SHARD_SIZE_DEFAULT = "5GB"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register the `consolidate` and `inspect` subcommands."""
    p = subparsers.add_parser(
        "consolidate", help="turn a sharded checkpoint into safetensors files (offline)",
        description="Write the full weights of a shardkit checkpoint (saved at any world size) as "
                    "safetensors with the original names, HF layout (index when split), reading "
                    "one tensor at a time; needs no process group or accelerator.")
    p.add_argument("checkpoint", metavar="CKPT_DIR")
    p.add_argument("out", metavar="OUT", help="output directory")
    p.add_argument("--max-shard-size", default=MAX_SHARD_SIZE_DEFAULT,
                   help="largest file, e.g. 5GB or 500MiB (default: %(default)s)")
    p.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the inputs")
    p.set_defaults(run=_consolidate)

    p = subparsers.add_parser(
        "inspect", help="print what a checkpoint holds",
        description="Print world size, strategy, step, versions, and every entry's shape and dtype.")
    p.add_argument("checkpoint", metavar="CKPT_DIR")
    p.add_argument("--json", action="store_true", help="print the same facts as JSON")
    p.set_defaults(run=_inspect)


def _consolidate(args: argparse.Namespace) -> int:
    from .offline import consolidate
    from .safetensors_io import parse_size

    size = args.max_shard_size
    out = consolidate(args.checkpoint, args.out, max_shard_size=int(size) if size.isdigit()
                      else parse_size(size), verify=not args.no_verify)
    print(f"wrote {out}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from .offline import format_inspection, inspect_checkpoint

    info = inspect_checkpoint(args.checkpoint)
    print(json.dumps(info, indent=1) if args.json else format_inspection(info))
    return 0
