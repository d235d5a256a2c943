"""The pip command that adds an extra to *this* shardkit install, as the user can run it.

shardkit is installed from a clone or from a built wheel until it is published, so a hint saying
``pip install 'shardkit[xla]'`` fails with "No matching distribution". pip records where a package
came from (PEP 610's ``direct_url.json``): a source directory (editable or not), a wheel file, or
an index. The hint names the same place, so it works from where the user stands; only an install
from an index gets the published-name form. Python run inside a clone imports the clone's package
(and may find a stale ``shardkit.egg-info`` there with no record), so a package that sits in a
source tree names that tree first.
"""

from __future__ import annotations

import json
import os
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse


def _direct_url() -> dict | None:
    """pip's record of where shardkit was installed from, or None (an index, or no record)."""
    try:
        text = metadata.distribution("shardkit").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None


def _local_path(url: str) -> str | None:
    """The filesystem path of a file:// URL, or None for any other scheme."""
    parsed = urlparse(url)
    return unquote(parsed.path) if parsed.scheme == "file" else None


def _source_tree() -> Path | None:
    """The clone the imported shardkit package lives in, or None when it is an installed copy."""
    root = Path(__file__).resolve().parent.parent
    setup_cfg = root / "setup.cfg"
    try:
        return root if "name = shardkit" in setup_cfg.read_text() else None
    except OSError:
        return None


def pip_install_extra(extra: str) -> str:
    """The `pip install` command that adds `extra` to the shardkit this process imported."""
    return install_command(extra, _source_tree(), _direct_url())


def install_command(extra: str, source_tree: Path | None, record: dict | None) -> str:
    """The `pip install` command for `extra`, given the clone shardkit runs from and pip's record."""
    if source_tree is not None:
        return f"pip install -e '{source_tree}[{extra}]'"
    path = _local_path(record.get("url", "")) if record else None
    if record and path and "dir_info" in record:
        editable = "-e " if record["dir_info"].get("editable") else ""
        return f"pip install {editable}'{path}[{extra}]'"
    if record and path and "archive_info" in record and os.path.exists(path):
        return f"pip install '{path}[{extra}]'"
    if record and path:  # a wheel since deleted: a clone is the way that always works
        return (f"pip install '.[{extra}]' from a shardkit clone (you installed "
                f"{os.path.basename(path)}, which is gone)")
    return f"pip install 'shardkit[{extra}]'"
