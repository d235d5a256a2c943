"""Damage a complete checkpoint the way disks and copies do, for the resume tests."""

from __future__ import annotations

import os
from pathlib import Path

from shardkit.checkpoint import manifest as mf


def flip_a_byte(checkpoint: Path) -> str:
    """Invert one byte in the middle of the checkpoint's largest data file; return its name."""
    manifest = mf.read_manifest(str(checkpoint))
    rel = max(manifest["files"], key=lambda r: manifest["files"][r]["size"])
    with open(checkpoint / rel, "r+b") as f:
        f.seek(manifest["files"][rel]["size"] // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    return rel
