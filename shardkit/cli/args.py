"""Argument types shared by the `shardkit` subcommands (argparse `type=` callables)."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """Parse an integer >= 1, or tell argparse what was wrong."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value
