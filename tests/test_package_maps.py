"""The maps stay true: every package's docstring names each of its modules, DEVELOPERS.md names
every top-level module and package of shardkit, and every file path the developer docs mention
exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "shardkit"
PACKAGES = sorted(init.parent for init in PACKAGE.rglob("__init__.py") if init.parent != PACKAGE)


def _members(package: Path) -> list[str]:
    modules = {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
    subpackages = {d.name for d in package.iterdir() if (d / "__init__.py").exists()}
    return sorted(modules | subpackages)


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_each_package_docstring_names_its_modules(package):
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    missing = [m for m in _members(package) if not re.search(rf"\b{re.escape(m)}\b", doc)]
    assert not missing, f"{package.relative_to(ROOT)}/__init__.py's docstring does not name {missing}"


def test_developers_md_names_every_top_level_module():
    text = (ROOT / "DEVELOPERS.md").read_text()
    missing = [m for m in _members(PACKAGE) if m not in text]
    assert not missing, f"DEVELOPERS.md does not name shardkit's {missing}"


def test_every_path_the_developer_docs_name_exists():
    for doc in ("DEVELOPERS.md", "docs/architecture.md", "README.md"):
        for path in re.findall(r"`([\w./-]+/[\w.-]+\.(?:py|md|sh|yml|toml|cfg))`",
                               (ROOT / doc).read_text()):
            candidates = [ROOT / path, PACKAGE / path, ROOT / "backends" / path]
            assert any(c.exists() for c in candidates), f"{doc} names {path}, which is not there"
