"""One parser for shardkit's on/off environment variables: 'on' is on everywhere, nonsense is refused."""

from __future__ import annotations

import pytest

import shardkit
from shardkit import env_flags
from shardkit.env_flags import env_flag
from shardkit.errors import PluginLoadError
from shardkit.testing import reset_state


@pytest.mark.parametrize("value,expected", [
    ("1", True), ("true", True), ("Yes", True), ("ON", True), (" on ", True),
    ("0", False), ("false", False), ("No", False), ("OFF", False)])
def test_every_spelling_of_on_and_off(value, expected, monkeypatch):
    monkeypatch.setenv("SHARDKIT_SOME_FLAG", value)
    assert env_flag("SHARDKIT_SOME_FLAG") is expected
    assert env_flag("SHARDKIT_SOME_FLAG", default=not expected) is expected


def test_unset_or_empty_is_the_default_and_nonsense_is_refused(monkeypatch):
    monkeypatch.delenv("SHARDKIT_SOME_FLAG", raising=False)
    assert env_flag("SHARDKIT_SOME_FLAG") is False and env_flag("SHARDKIT_SOME_FLAG", True) is True
    monkeypatch.setenv("SHARDKIT_SOME_FLAG", "  ")
    assert env_flag("SHARDKIT_SOME_FLAG", True) is True
    monkeypatch.setenv("SHARDKIT_SOME_FLAG", "disable")
    with pytest.raises(shardkit.ShardkitError, match=r"SHARDKIT_SOME_FLAG='disable' is neither on "
                                                     r"nor off: set it to one of 1, true, yes, on"):
        env_flag("SHARDKIT_SOME_FLAG")


def test_strict_plugins_on_means_on(fake_plugins, monkeypatch):
    # Read by a parser of its own before, "on" was off: the broken plugin was skipped silently.
    monkeypatch.setenv("SHARDKIT_STRICT_PLUGINS", "on")
    reset_state()
    with pytest.raises(PluginLoadError, match="libfrobnicate"):
        shardkit.get_backend("cpu")


def test_plugin_autoload_off_means_off(fake_plugins, monkeypatch):
    # Before, only 0/false/no turned it off: "off" loaded third-party plugins anyway.
    monkeypatch.setenv("SHARDKIT_PLUGIN_AUTOLOAD", "off")
    reset_state()
    names = [s.name for s in shardkit.backend_statuses()]
    assert "toygloo" not in names and "cpu" in names


def test_debug_and_watchdog_are_named_once():
    from shardkit import failure
    from shardkit.sharding.step import verify

    assert failure.DEBUG_ENV is env_flags.DEBUG and verify.ENV is env_flags.DEBUG
    assert failure.WATCHDOG_ENV is env_flags.WATCHDOG
