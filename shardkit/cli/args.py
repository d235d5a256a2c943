"""Argument types shared by the `shardkit` subcommands (argparse `type=` callables)."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """Parse an integer >= 1, or tell argparse what was wrong."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


# ShardingStrategy's names, spelled out so that parsing needs no torch (a test keeps them equal).
STRATEGY_NAMES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")

# The environment variables a user reaches for most, for --help epilogs (docs/guide/settings.md has all).
ENVIRONMENT_HELP = """environment:
  SHARDKIT_LOG=info|debug   print what shardkit decides (backend, units, sizes; debug: every
                            collective) to stderr; -v / -vv set it for one command
  SHARDKIT_DEBUG=1          check before every collective that all ranks issue the same one
  SHARDKIT_TIMEOUT=SECONDS  how long a rank waits on a silent or failed peer (default 30 s on
                            cpu, 10 minutes on accelerators)
  SHARDKIT_BACKEND=NAME     the backend to use (see `shardkit info`)
  SHARDKIT_WATCHDOG=0       no per-rank watchdog; failures surface only as collective timeouts
  MASTER_ADDR, MASTER_PORT  rendezvous of hand-made launches (default 127.0.0.1:29500)
more: docs/guide/settings.md (the Settings page of the documentation)"""
