"""Every name the API reference documents imports from the path it is documented at, and every
public name of the shardkit face resolves (modules moved between rooms keep these working)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import shardkit

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "reference"
DOCUMENTED = sorted({m.group(1) for page in REFERENCE.glob("*.md")
                     for m in re.finditer(r"^::: ([\w.]+)", page.read_text(), re.M)})


def _resolve(path: str) -> object:
    """The object at a dotted path: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(path)


def test_the_reference_documents_names():
    assert len(DOCUMENTED) > 40 and "shardkit.sharding.shard" in DOCUMENTED


@pytest.mark.parametrize("path", DOCUMENTED)
def test_documented_name_imports(path):
    assert _resolve(path) is not None


@pytest.mark.parametrize("name", shardkit.__all__)
def test_public_name_of_the_face_resolves(name):
    assert getattr(shardkit, name) is not None
