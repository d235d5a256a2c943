"""`shardkit --version`, `shardkit info` and `shardkit info --json` on this machine."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pluggy
import pytest
import torch

import shardkit
from fake_plugin_site import subprocess_env
from shardkit import Backend, hookimpl
from shardkit.cli.main import main
from shardkit.install_hint import pip_install_extra

BUILTINS = ("cpu", "cuda", "xpu", "xla")


def expected_available() -> dict[str, bool]:
    """Availability of each built-in, decided from torch itself rather than from shardkit."""
    import torch.distributed as dist

    return {"cpu": dist.is_available() and dist.is_gloo_available(),
            "cuda": torch.cuda.is_available() and dist.is_nccl_available(),
            "xpu": hasattr(torch, "xpu") and torch.xpu.is_available(),
            "xla": importlib.util.find_spec("torch_xla") is not None}


def flat(text: str) -> str:
    """`text` with every run of whitespace made one space, so wrapped lines compare whole."""
    return " ".join(text.split())


def run_cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str]:
    """Run the CLI in-process; return (exit status, stdout)."""
    status = main(list(argv))
    return status, capsys.readouterr().out


def test_version(capsys: pytest.CaptureFixture) -> None:
    """--version prints the package version and exits 0."""
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"shardkit {shardkit.__version__}"


def test_no_command_prints_help(capsys: pytest.CaptureFixture) -> None:
    """A bare `shardkit` lists the commands."""
    status, out = run_cli(capsys)
    assert status == 0 and "info" in out and "usage: shardkit" in out


def test_info_json_describes_every_backend(fresh_plugins: None, capsys: pytest.CaptureFixture) -> None:
    """--json: versions, and for each built-in its availability, reason, hint and capabilities."""
    status, out = run_cli(capsys, "info", "--json")
    assert status == 0
    facts = json.loads(out)
    assert (facts["shardkit"], facts["torch"], facts["pluggy"]) == (
        shardkit.__version__, torch.__version__, pluggy.__version__)
    assert facts["python"] == ".".join(map(str, sys.version_info[:3]))
    backends = {b["name"]: b for b in facts["backends"]}
    assert [b["name"] for b in facts["backends"]] == [
        st.name for st in shardkit.backend_statuses()]  # highest priority first
    for name, available in expected_available().items():
        b = backends[name]
        assert b["available"] is available, b
        assert (b["plugin"], b["distribution"], b["entry_point"]) == (
            name, "shardkit", f"shardkit_backends.{name}")
        assert b["capabilities"] == shardkit.backend_statuses()[
            [st.name for st in shardkit.backend_statuses()].index(name)].cls.capabilities.describe()
        if available:
            assert b["reason"] is None and b["hint"] is None
            assert isinstance(b["device_count"], int) and b["device_count"] >= 1
        else:
            assert b["reason"] and b["device_count"] is None
            assert pip_install_extra(name) in b["hint"]
    cpu = backends["cpu"]
    assert (cpu["device_count"], cpu["process_group_backend"], cpu["priority"]) == (1, "gloo", 0)
    assert cpu["versions"] == {"torch": torch.__version__}
    assert backends["xla"]["auto_select"] is False  # PJRT_DEVICE is not set
    assert facts["default_backend"] == shardkit.get_backend().name
    assert facts["failed_plugins"] == []


def test_info_table_reads_well(fresh_plugins: None, capsys: pytest.CaptureFixture) -> None:
    """The text report has the header, one table row per backend, and reason + HINT for each miss."""
    status, out = run_cli(capsys, "info")
    assert status == 0
    lines = out.splitlines()
    assert lines[0] == (f"shardkit {shardkit.__version__}  |  python {sys.version.split()[0]}  |  "
                        f"torch {torch.__version__}  |  pluggy {pluggy.__version__}")
    header = next(i for i, line in enumerate(lines) if line.startswith("BACKEND"))
    assert lines[header].split() == ["BACKEND", "AVAILABLE", "DEVICES", "PROCESS", "GROUP",
                                     "PRIORITY", "AUTO-SELECT", "PLUGIN"]
    end = lines.index("", header)
    rows = {line.split()[0]: line.split() for line in lines[header + 1:end]}
    assert len(rows) == len(shardkit.backend_statuses())
    assert rows["cpu"][:6] == ["cpu", "yes", "1", "gloo", "0", "yes"]
    for st in shardkit.backend_statuses():
        assert rows[st.name][1] == ("yes" if st.available else "no")
        if not st.available:
            assert rows[st.name][2] == "-"
            assert flat(f"{st.name}: not available: {st.reason} HINT: {st.hint}") in flat(out)
    assert f"default backend here: {shardkit.get_backend().name}" in out
    assert flat(f"versions: torch {torch.__version__}") in flat(out)


class ExplodingBackend(Backend):
    """Available, but every informational method raises."""

    name = "exploding"
    device_type = "cpu"
    priority = -1

    @classmethod
    def is_available(cls) -> bool:
        """Yes."""
        return True

    @classmethod
    def requirement_hint(cls) -> str:
        """Nothing to install."""
        return "nothing"

    @classmethod
    def versions(cls) -> dict[str, str]:
        """Broken on purpose."""
        raise RuntimeError("versions exploded")

    def local_device(self, local_rank: int) -> torch.device:
        """Host."""
        return torch.device("cpu")

    def device_count(self) -> int:
        """Broken on purpose."""
        raise RuntimeError("device_count exploded")

    def process_group_backend(self) -> str:
        """gloo."""
        return "gloo"


class ExplodingPlugin:
    """Registers ExplodingBackend."""

    @hookimpl
    def shardkit_register_backends(self, registry) -> None:
        """Add it."""
        registry.add(ExplodingBackend)


def test_info_survives_a_misbehaving_backend(fresh_plugins: None, capsys: pytest.CaptureFixture) -> None:
    """A backend whose methods raise is reported with the error; info still exits 0."""
    shardkit.register_plugin(ExplodingPlugin(), "exploding")
    status, out = run_cli(capsys, "info")
    assert status == 0
    row = next(line for line in out.splitlines() if line.startswith("exploding "))
    assert row.split()[:4] == ["exploding", "yes", "-", "gloo"]
    assert "exploding (registered in code)" in row
    assert "device_count() raised: RuntimeError: device_count exploded" in flat(out)
    assert "versions() raised: RuntimeError: versions exploded" in flat(out)


def test_info_shows_third_party_and_failed_plugins(fake_plugins: list[str],
                                                   capsys: pytest.CaptureFixture) -> None:
    """An installed plugin appears with its distribution; a failed one with its error and a HINT."""
    status, out = run_cli(capsys, "info")
    assert status == 0
    row = next(line for line in out.splitlines() if line.startswith("toygloo "))
    assert row.split()[:6] == ["toygloo", "yes", "1", "gloo", "0", "yes"]
    assert row.endswith("toygloo (shardkit-fake-plugins 0.1.0)")
    assert ("broken (shardkit_broken_plugin): ImportError: shardkit_broken_plugin needs "
            "libfrobnicate, which is not installed") in out
    assert "SHARDKIT_DISABLED_PLUGINS=broken" in out
    status, out = run_cli(capsys, "info", "--json")
    failed = json.loads(out)["failed_plugins"]
    assert [f["plugin"] for f in failed] == ["broken"]
    assert "shardkit_broken_plugin.py" in failed[0]["traceback"]


@pytest.mark.slow
def test_console_script_and_module_entry(fake_plugin_paths: list[str]) -> None:
    """The installed `shardkit` script and `python -m shardkit` run; strict mode fails with status 1."""
    script = Path(sys.executable).with_name("shardkit")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "shardkit"]
    proc = subprocess.run(command + ["info", "--json"], env=subprocess_env(fake_plugin_paths),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    names = {b["name"] for b in json.loads(proc.stdout)["backends"]}
    assert names == set(BUILTINS) | {"toygloo"}
    proc = subprocess.run([sys.executable, "-m", "shardkit", "info"],
                          env=subprocess_env(fake_plugin_paths, SHARDKIT_STRICT_PLUGINS="1"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.startswith("shardkit: error: plugin 'broken'") and "libfrobnicate" in proc.stderr



def test_commands_import_only_their_own_module() -> None:
    """With the demo package unimportable (as when a wheel lacked it), every other command still works."""
    code = textwrap.dedent("""
        import json, sys
        sys.modules["shardkit.demo"] = None  # any import of the demo now fails
        from shardkit.cli.main import main
        assert main(["info", "--json"]) == 0
        assert main([]) == 0  # the help lists demo without importing it
        try:
            main(["demo", "--epochs", "1"])
        except ImportError:
            print("demo refused")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert '"default_backend"' in proc.stdout and "demo refused" in proc.stdout
