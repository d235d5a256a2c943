"""Plugin discovery, selection and registry validation, with a real third-party distribution.

tests/fake_plugin is a plugin distribution (entry-point group `shardkit`: toygloo, a working
backend written with only the required members; broken, whose import raises). The fixtures in
conftest.py (built on fake_plugin_site) put its metadata on sys.path, as `pip install` would.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from typing import Any

import pytest
import torch

import shardkit
from fake_plugin_site import subprocess_env
from shardkit import (Backend, BackendNotFoundError, BackendUnavailableError, PluginLoadError,
                      ShardkitError, hookimpl)
from shardkit.plugin import BackendRegistry
from shardkit.plugin.manager import plugin_state
from shardkit.testing import reset_state, run_conformance

REQUIRED_MEMBERS = {"name", "device_type", "is_available", "requirement_hint", "local_device",
                    "device_count", "process_group_backend"}


def run_python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter (env vars are read at discovery, once per process)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=120)


# ---- discovery ---------------------------------------------------------------------------------

def test_toygloo_is_discovered_through_its_entry_point(fake_plugins: list[str]) -> None:
    """The fake distribution's entry point is found by importlib.metadata and registers toygloo."""
    eps = {ep.name: ep for ep in entry_points(group="shardkit")}
    assert eps["toygloo"].dist.name == "shardkit-fake-plugins"
    assert eps["toygloo"].value == "shardkit_toygloo"
    statuses = {st.name: st for st in shardkit.backend_statuses()}
    assert statuses["toygloo"].available and statuses["toygloo"].plugin == "toygloo"
    backend = shardkit.get_backend("toygloo")
    assert type(backend).__module__ == "shardkit_toygloo"
    assert backend is shardkit.get_backend("toygloo")  # one instance per process
    assert backend.process_group_backend() == "gloo" and backend.device_type == "cpu"


def test_toygloo_defines_only_the_required_members(fake_plugins: list[str]) -> None:
    """A third-party backend needs the required members, an entry point, and (ranks sharing one host device) max_local_ranks."""
    cls = type(shardkit.get_backend("toygloo"))
    own = {k for k in vars(cls) if not k.startswith("__")}
    assert own == REQUIRED_MEMBERS | {"max_local_ranks"}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_toygloo_passes_conformance(fake_plugins: list[str]) -> None:
    """The suite plugin authors run, on toygloo in two spawned processes."""
    run_conformance("toygloo", world_sizes=(2,)).raise_for_failures()


def test_plugins_disabled_by_env_are_skipped(fake_plugins: list[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """SHARDKIT_DISABLED_PLUGINS=a,b neither imports nor registers a or b."""
    monkeypatch.setenv("SHARDKIT_DISABLED_PLUGINS", " broken , toygloo,cuda")
    state = plugin_state()
    names = set(state.registry.names())
    assert "toygloo" not in names and "cuda" not in names and "cpu" in names
    assert state.failures == {}
    assert "shardkit_toygloo" not in sys.modules
    with pytest.raises(BackendNotFoundError):
        shardkit.get_backend("toygloo")


# ---- a plugin that fails to import ---------------------------------------------------------------

def test_broken_plugin_fails_only_when_selected(fake_plugins: list[str]) -> None:
    """The broken plugin is recorded; the rest works; selecting it raises with its traceback."""
    assert "cpu" in {st.name for st in shardkit.backend_statuses()}
    assert "broken" in plugin_state().failures
    with pytest.raises(PluginLoadError) as info:
        shardkit.get_backend("broken")
    message = str(info.value)
    assert "needs libfrobnicate" in message and "original traceback" in message
    assert "shardkit_broken_plugin.py" in message and "Traceback (most recent call last)" in message


def test_broken_plugin_in_a_fresh_interpreter(fake_plugin_paths: list[str]) -> None:
    """`import shardkit` and default selection work; selecting the broken plugin raises."""
    code = """
        import shardkit
        print("default", shardkit.get_backend().name)
        try:
            shardkit.get_backend("broken")
        except shardkit.PluginLoadError as exc:
            print("selected", type(exc).__name__, "libfrobnicate" in str(exc))
    """
    proc = run_python(code, subprocess_env(fake_plugin_paths, SHARDKIT_DISABLED_PLUGINS="cuda,xpu"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["default cpu", "selected PluginLoadError True"]


def test_strict_plugins_reraise_at_discovery(fake_plugins: list[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """SHARDKIT_STRICT_PLUGINS=1 turns a plugin failure into an error at discovery."""
    monkeypatch.setenv("SHARDKIT_STRICT_PLUGINS", "1")
    with pytest.raises(PluginLoadError, match="libfrobnicate") as info:
        shardkit.get_backend("cpu")
    assert isinstance(info.value.__cause__, ImportError)
    monkeypatch.setenv("SHARDKIT_DISABLED_PLUGINS", "broken")
    reset_state()
    assert shardkit.get_backend("toygloo").name == "toygloo"


# ---- SHARDKIT_BACKEND and errors --------------------------------------------------------------

def test_shardkit_backend_env_selects_in_a_fresh_interpreter(fake_plugin_paths: list[str]) -> None:
    """SHARDKIT_BACKEND=toygloo makes shardkit.get_backend() and init() use the plugin."""
    code = """
        import shardkit
        ctx = shardkit.init()
        print(shardkit.get_backend().name, ctx.backend.name, shardkit.get_backend("cpu").name)
        shardkit.shutdown()
    """
    env = subprocess_env(fake_plugin_paths, SHARDKIT_BACKEND="toygloo")
    for key in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
        env.pop(key, None)
    proc = run_python(code, env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "toygloo toygloo cpu"


class NeverBackend(Backend):
    """Registered but never runnable, with a reason and a hint the error must carry."""

    name = "never"
    device_type = "cpu"
    priority = 1000

    @classmethod
    def is_available(cls) -> bool:
        """Never."""
        return False

    @classmethod
    def unavailable_reason(cls) -> str:
        """A reason a user can act on."""
        return "no frobnicator card is plugged in"

    @classmethod
    def requirement_hint(cls) -> str:
        """The pip extra that would fix it."""
        return "pip install 'shardkit[never]'"

    def local_device(self, local_rank: int) -> torch.device:
        """Host."""
        return torch.device("cpu")

    def device_count(self) -> int:
        """None visible."""
        return 0

    def process_group_backend(self) -> str:
        """gloo."""
        return "gloo"


class NeverPlugin:
    """Registers NeverBackend."""

    @hookimpl
    def shardkit_register_backends(self, registry: BackendRegistry) -> None:
        """Add the never-available backend."""
        registry.add(NeverBackend)


def test_unknown_env_backend_lists_registered_backends(fresh_plugins: None,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """An unknown SHARDKIT_BACKEND names the variable and lists every backend, why not, and HINT."""
    shardkit.register_plugin(NeverPlugin(), "never")
    monkeypatch.setenv("SHARDKIT_BACKEND", "nope")
    with pytest.raises(BackendNotFoundError) as info:
        shardkit.get_backend()
    message = str(info.value)
    assert "SHARDKIT_BACKEND='nope'" in message and "unknown backend 'nope'" in message
    for st in shardkit.backend_statuses():
        assert f"- {st.name}:" in message
        if not st.available:
            assert st.reason in message and f"HINT: {st.hint}" in message
    assert "no frobnicator card is plugged in. HINT: pip install 'shardkit[never]'" in message


def test_unavailable_backend_by_name_explains_why(fresh_plugins: None,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Asking for a registered but unavailable backend gives its reason and pip extra."""
    shardkit.register_plugin(NeverPlugin(), "never")
    for ask in (lambda: shardkit.get_backend("never"),
                lambda: (monkeypatch.setenv("SHARDKIT_BACKEND", "never"), shardkit.get_backend())):
        with pytest.raises(BackendUnavailableError) as info:
            ask()
        assert "'never' is not available: no frobnicator card is plugged in" in str(info.value)
        assert "HINT: pip install 'shardkit[never]'" in str(info.value)
    monkeypatch.delenv("SHARDKIT_BACKEND")
    assert shardkit.get_backend().name != "never"  # highest priority, but never auto-picked


def test_backend_argument_must_be_a_name_or_backend(fresh_plugins: None) -> None:
    """A wrong type is a ShardkitError; a Backend object passes through untouched."""
    with pytest.raises(ShardkitError, match="name or a Backend"):
        shardkit.get_backend(3)  # type: ignore[arg-type]
    be = shardkit.get_backend("cpu")
    assert shardkit.get_backend(be) is be


# ---- the site-policy hook and auto-detection ----------------------------------------------------

class SitePolicy:
    """A shardkit_select_backend hook that records what it was offered."""

    def __init__(self, choice: str | None) -> None:
        self.choice, self.calls = choice, []

    @hookimpl
    def shardkit_select_backend(self, available: Any, registered: Any) -> str | None:
        """Return the configured choice."""
        self.calls.append((list(available), list(registered)))
        return self.choice


def test_select_hook_is_honoured(fake_plugins: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The hook picks when nothing else did; an explicit name and SHARDKIT_BACKEND beat it."""
    policy = SitePolicy("toygloo")
    shardkit.register_plugin(policy, "site-policy")
    assert shardkit.get_backend().name == "toygloo"
    available, registered = policy.calls[0]
    assert "toygloo" in available and "cpu" in available and "toygloo" in registered
    expected = [st.name for st in shardkit.backend_statuses()
                if st.available and st.cls.auto_select_now()]
    assert available == expected  # best first, by priority
    assert shardkit.get_backend("cpu").name == "cpu"
    monkeypatch.setenv("SHARDKIT_BACKEND", "cpu")
    calls = len(policy.calls)
    assert shardkit.get_backend().name == "cpu" and len(policy.calls) == calls


def test_select_hook_returning_none_falls_back_to_priority(fresh_plugins: None) -> None:
    """A hook that abstains leaves auto-detection to priority."""
    shardkit.register_plugin(SitePolicy(None), "abstain")
    best = [st for st in shardkit.backend_statuses() if st.available and st.cls.auto_select_now()][0]
    assert shardkit.get_backend().name == best.name


def test_xla_is_auto_selected_only_with_pjrt_device(fresh_plugins: None,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Even when torch_xla is importable, xla wins auto-detection only if PJRT_DEVICE is set."""
    from shardkit_backends.xla import XLABackend

    monkeypatch.setenv("SHARDKIT_DISABLED_PLUGINS", "cuda,xpu")
    monkeypatch.setattr(XLABackend, "is_available", classmethod(lambda cls: True))
    assert XLABackend.priority > shardkit.get_backend("cpu").priority
    assert shardkit.get_backend().name == "cpu"
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    assert shardkit.get_backend().name == "xla"
    assert shardkit.get_backend("cpu").name == "cpu"  # by name, the flag does not matter


def test_auto_detection_prefers_higher_priority(fake_plugins: list[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Among available auto-selectable backends the highest priority wins."""
    monkeypatch.setenv("SHARDKIT_DISABLED_PLUGINS", "cuda,xpu,xla")
    import shardkit_toygloo

    assert shardkit.get_backend().name == "cpu"  # cpu 0 vs toygloo 0: ties go by name
    monkeypatch.setattr(shardkit_toygloo.ToyGlooBackend, "priority", 5)
    reset_state()
    assert shardkit.get_backend().name == "toygloo"


# ---- registry validation -------------------------------------------------------------------------

def _backend(name: str = "valid", **members: Any) -> type[Backend]:
    """A Backend subclass with the required members, overridden by `members`."""
    body = {"name": name, "device_type": "cpu",
            "is_available": classmethod(lambda cls: True),
            "requirement_hint": classmethod(lambda cls: "nothing"),
            "local_device": lambda self, local_rank: torch.device("cpu"),
            "device_count": lambda self: 1,
            "process_group_backend": lambda self: "gloo"}
    body.update(members)
    return type(f"{name.title()}Backend", (Backend,), {k: v for k, v in body.items() if v is not None})


@pytest.mark.parametrize("cls,message", [
    (object, "not a subclass of shardkit.Backend"),
    (42, "not a subclass of shardkit.Backend"),
    (_backend(process_group_backend=None), "required member(s) ['process_group_backend']"),
    (_backend(is_available=None, device_count=None), "['is_available', 'device_count']"),
    (_backend(name="not-a-name"), "an identifier, got 'not-a-name'"),
    (_backend(device_type=None), "device_type"),
    (_backend(requires_api=shardkit.API_VERSION + 1), "upgrade shardkit"),
])
def test_registry_rejects_invalid_backends(cls: Any, message: str) -> None:
    """Each validation error says what is wrong."""
    registry = BackendRegistry()
    registry.current_plugin = "acme"
    with pytest.raises(ShardkitError) as info:
        registry.add(cls)
    assert message in str(info.value)
    assert len(registry) == 0


def test_registry_rejects_a_duplicate_name() -> None:
    """Two plugins claiming one name: the error names both; re-adding the same class is fine."""
    registry = BackendRegistry()
    first, second = _backend("dup"), _backend("dup")
    registry.current_plugin = "alpha"
    registry.add(first)
    registry.add(first)
    registry.current_plugin = "beta"
    with pytest.raises(ShardkitError, match="registered twice: by plugin 'alpha' and by plugin 'beta'"):
        registry.add(second)
    assert registry.get("dup") is first and registry.origin("dup") == "alpha"


def test_plugin_registering_a_duplicate_is_recorded_not_fatal(fresh_plugins: None) -> None:
    """A plugin whose registration fails is dropped whole and reported; built-ins keep working."""

    class Clash:
        @hookimpl
        def shardkit_register_backends(self, registry: BackendRegistry) -> None:
            registry.add(_backend("extra"))
            registry.add(_backend("cpu"))  # clashes with the built-in

    shardkit.register_plugin(Clash(), "clash")
    state = plugin_state()
    assert "registered twice" in state.failures["clash"].error
    assert "extra" not in state.registry  # nothing half-registered
    assert type(shardkit.get_backend("cpu")).__module__ == "shardkit_backends.cpu"


def test_builtin_backends_register_through_entry_points(fresh_plugins: None) -> None:
    """cpu, cuda, xpu and xla come from the `shardkit` group, like any plugin."""
    eps = {ep.name: ep.value for ep in entry_points(group="shardkit")}
    for name in ("cpu", "cuda", "xpu", "xla"):
        assert eps[name] == f"shardkit_backends.{name}"
        assert plugin_state().registry.origin(name) == name



# ---- hook names are checked; one reset for all process-global state ------------------------------

class MisspelledPlugin:
    """Implements `shardkit_register_backend` (no s): a hook shardkit does not have."""

    @hookimpl
    def shardkit_register_backend(self, registry: BackendRegistry) -> None:
        """Never called: no hookspec has this name."""
        registry.add(NeverBackend)


def test_misspelled_hook_is_a_recorded_failure_shown_by_info(fresh_plugins: None,
                                                             capsys: pytest.CaptureFixture) -> None:
    """pluggy's check_pending turns an unknown hook name into a plugin failure that `info` lists."""
    from shardkit.cli.main import main

    shardkit.register_plugin(MisspelledPlugin(), "typo")
    failure = plugin_state().failures["typo"]
    assert "shardkit_register_backend" in failure.error
    assert "shardkit_register_backends" in failure.error  # the hint names the real hooks
    assert "never" not in plugin_state().registry.names()
    assert not plugin_state().pm.has_plugin("typo")
    capsys.readouterr()
    assert main(["info", "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert [f["plugin"] for f in facts["failed_plugins"]] == ["typo"]
    assert "unknown hook 'shardkit_register_backend'" in facts["failed_plugins"][0]["error"]


def test_misspelled_hook_raises_in_strict_mode(fresh_plugins: None,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """SHARDKIT_STRICT_PLUGINS=1 raises the same failure at registration."""
    monkeypatch.setenv("SHARDKIT_STRICT_PLUGINS", "1")
    with pytest.raises(PluginLoadError, match="unknown hook 'shardkit_register_backend'"):
        shardkit.register_plugin(MisspelledPlugin(), "typo")


def test_reset_state_clears_context_plugins_backends_and_xla_barriers(fresh_plugins: None) -> None:
    """reset_state() shuts the context down, forgets plugins and backends, and the xla plugin's barriers."""
    from shardkit_backends.xla import threads

    cpu = shardkit.get_backend("cpu")
    state = plugin_state()
    threads.shared_barrier((0, 1), 0)
    ctx = shardkit.init("cpu")
    assert shardkit.current_context() is ctx and torch.distributed.is_initialized()
    reset_state()
    assert shardkit.current_context() is None and not torch.distributed.is_initialized()
    assert threads._GROUP_BARRIERS == {}
    assert plugin_state() is not state and shardkit.get_backend("cpu") is not cpu


def test_test_only_names_are_not_public() -> None:
    """shardkit.__all__ holds the user API; resetting global state lives in shardkit.testing."""
    assert "reset_plugins" not in shardkit.__all__ and not hasattr(shardkit, "reset_plugins")
    assert all(hasattr(shardkit, name) for name in shardkit.__all__)
