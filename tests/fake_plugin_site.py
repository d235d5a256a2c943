"""Make tests/fake_plugin importable with real entry-point metadata, without pip or network.

`make_site(dir)` writes the ``*.dist-info`` that installing tests/fake_plugin would write
(METADATA + entry_points.txt, read from its setup.cfg) and returns the sys.path entries that make
both the metadata and the plugin modules visible; subprocesses get them through PYTHONPATH.
The fixtures built on it live in tests/conftest.py.
"""

from __future__ import annotations

import configparser
import os
from pathlib import Path

FAKE_PLUGIN_DIR = Path(__file__).resolve().parent / "fake_plugin"


def make_site(site_dir: Path) -> list[str]:
    """Write the fake plugin's dist-info under `site_dir`; return the paths to put on sys.path."""
    cfg = configparser.ConfigParser()
    cfg.read(FAKE_PLUGIN_DIR / "setup.cfg")
    name, version = cfg["metadata"]["name"], cfg["metadata"]["version"]
    dist_info = Path(site_dir) / f"{name.replace('-', '_')}-{version}.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    # setup.cfg nests each group's "name = target" lines under the group key.
    targets = [line.strip() for line in cfg["options.entry_points"]["shardkit"].splitlines()]
    lines = ["[shardkit]"] + [t for t in targets if t]
    (dist_info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return [str(site_dir), str(FAKE_PLUGIN_DIR)]


def subprocess_env(paths: list[str], **overrides: str) -> dict[str, str]:
    """Return os.environ with `paths` prepended to PYTHONPATH, shardkit's own env vars cleared."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDKIT_")}
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(overrides)
    return env
