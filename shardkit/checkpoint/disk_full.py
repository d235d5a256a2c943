"""A full disk named as one: torch's zip writer says "unexpected pos N vs M" for a short write."""

from __future__ import annotations

import os
import shutil


# torch's zip writer reports a short write (a full disk) as "unexpected pos N vs M" or "file
# write failed", and DCP passes that on. Those words, or this little free space left, mean the
# disk filled up (free space is read after the fact: another rank may already have freed some).
NEARLY_FULL_BYTES = 1 << 20
_SHORT_WRITE_WORDS = ("unexpected pos", "file write failed")


def name_a_full_disk(directory: str, cause: str) -> str:
    """Say "no space left on device" when the file system is (nearly) full, whatever torch said."""
    if "No space left on device" in cause:
        return cause
    free = free_bytes(directory)
    short_write = any(words in cause for words in _SHORT_WRITE_WORDS)
    if not short_write and (free is None or free >= NEARLY_FULL_BYTES):
        return cause
    measured = "" if free is None else f"{free} bytes free on the file system; "
    return f"no space left on device ({measured}torch said: {cause})"


def free_bytes(directory: str) -> int | None:
    """Free bytes on the file system of `directory` (or of its parent), None if neither exists."""
    # Another rank may remove the temporary directory between this rank's look and its
    # measurement: fall back to the parent.
    for probe in (directory, os.path.dirname(directory)):
        try:
            return shutil.disk_usage(probe).free
        except OSError:
            continue
    return None
