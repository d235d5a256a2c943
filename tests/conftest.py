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


def _left_out(item: pytest.Item, markexpr: str) -> bool:
    """Whether a run with this `-m` leaves `item` out: `extended` and `long` run only when named."""
    if item.get_closest_marker("extended") is not None:
        return "extended" not in markexpr
    return item.get_closest_marker("long") is not None and "long" not in markexpr


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leave `long` and `extended` tests out of every run whose `-m` does not name them.

    A `-m 'not long'` in addopts would be replaced by any `-m` on the command line, so the quick
    lane (`-m "not slow"`) used to run the whole long lane too (issue 57). An `extended` case of a
    long test's table runs only in the extended lane (`-m extended`), not in CI's long lane.
    """
    markexpr = config.getoption("markexpr") or ""
    left_out = [item for item in items if _left_out(item, markexpr)]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if not _left_out(item, markexpr)]
