"""The engine reaches a backend's members through its sides (`backend.devices`, `backend.collectives`).

A pair of two backends' sides ("cuda+gloo") answers through its two attributes and nothing else
(shardkit/composed.py); a member called on a backend itself would run the pair's inherited
default at run time (it is refused there, but only on the path a test happens to take). This scan
finds such a call anywhere in shardkit/ before it runs.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from shardkit.backend import CollectiveSide, DeviceSide, side_members

PACKAGE = Path(__file__).resolve().parent.parent / "shardkit"
SIDES = {**{m: "devices" for m in side_members(DeviceSide)},
         **{m: "collectives" for m in side_members(CollectiveSide)}}
# What the package calls a backend: `backend`, `self._backend`, `ctx.backend`, `be`, ...
BACKEND_RECEIVER = re.compile(r"(?:^|\.)(?:\w*backend|be)$")
# Where a backend's own members are written, not called through a side.
OWNERS = {"backend.py", "composed.py"}


def calls_past_the_sides(source: str) -> list[tuple[int, str]]:
    """Return (line, call) for every side member called directly on something named as a backend."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in SIDES):
            continue
        receiver = ast.unparse(node.func.value)
        if BACKEND_RECEIVER.search(receiver):
            hits.append((node.lineno, f"{receiver}.{node.func.attr}(...): use "
                                      f"{receiver}.{SIDES[node.func.attr]}.{node.func.attr}"))
    return hits


def test_checker_flags_a_call_past_the_sides() -> None:
    """Direct calls are found whatever the backend is called; calls through a side and others' methods are not."""
    sample = "\n".join([
        "backend.all_reduce(t, group)",
        "self._backend.new_stream(device)",
        "ctx.backend.free_storage(t)",
        "be.barrier(group)",
        "backend.collectives.all_reduce(t, group)",
        "backend.devices.new_stream(device)",
        "stats.all_reduce(n, 2)",
        "manager.shutdown()",
    ])
    assert [line for line, _ in calls_past_the_sides(sample)] == [1, 2, 3, 4]


def test_the_package_calls_backends_through_their_sides() -> None:
    """No module of shardkit/ (but the backend's own definitions) calls a side member on a backend itself."""
    files = [p for p in sorted(PACKAGE.rglob("*.py")) if p.name not in OWNERS or p.parent != PACKAGE]
    assert any(p.name == "conformance.py" for p in files)  # the scan really looks at the package
    hits = [f"{path.relative_to(PACKAGE.parent)}:{line}: {text}" for path in files
            for line, text in calls_past_the_sides(path.read_text(encoding="utf-8"))]
    assert not hits, "side members called on a backend itself:\n" + "\n".join(hits)
