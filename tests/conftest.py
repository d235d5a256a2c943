"""Fixtures shared by the test modules (pytest finds them here; nothing imports them by name)."""

from __future__ import annotations

import os
import sys
from typing import Iterator

import pytest

from fake_plugin_site import make_site
from shardkit.testing import reset_state


@pytest.fixture(scope="session")
def fake_plugin_paths(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """sys.path entries under which tests/fake_plugin is 'installed' (for subprocesses: PYTHONPATH)."""
    return make_site(tmp_path_factory.mktemp("fake_plugin_site"))


@pytest.fixture
def fresh_plugins(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Rediscover plugins before and after the test, with shardkit's env vars unset."""
    for key in [k for k in os.environ if k.startswith("SHARDKIT_")] + ["PJRT_DEVICE"]:
        monkeypatch.delenv(key, raising=False)
    reset_state()
    yield
    reset_state()


@pytest.fixture
def fake_plugins(fake_plugin_paths: list[str], monkeypatch: pytest.MonkeyPatch,
                 fresh_plugins: None) -> Iterator[list[str]]:
    """The fake plugin distribution visible to this process (and to processes it spawns)."""
    for path in reversed(fake_plugin_paths):
        monkeypatch.syspath_prepend(path)
    yield fake_plugin_paths
    for module in ("shardkit_toygloo", "shardkit_broken_plugin"):
        sys.modules.pop(module, None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leave `long` tests out of every run whose `-m` does not name them.

    A `-m 'not long'` in addopts would be replaced by any `-m` on the command line, so the quick
    lane (`-m "not slow"`) used to run the whole long lane too (issue 57).
    """
    if "long" in (config.getoption("markexpr") or ""):
        return
    kept = [item for item in items if item.get_closest_marker("long") is None]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i.get_closest_marker("long")])
        items[:] = kept
