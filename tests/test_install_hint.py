"""Install hints name a command that works from where the user stands (shardkit is unpublished)."""

from __future__ import annotations

from pathlib import Path

import shardkit
from shardkit.install_hint import install_command, pip_install_extra


def test_a_clone_is_named_by_its_path():
    assert install_command("xla", Path("/src/shardkit"), None) == "pip install -e '/src/shardkit[xla]'"


def test_the_record_pip_kept_names_the_directory_or_wheel(tmp_path):
    editable = {"url": "file:///src/shardkit", "dir_info": {"editable": True}}
    assert install_command("hf", None, editable) == "pip install -e '/src/shardkit[hf]'"
    plain = {"url": "file:///src/my%20clone", "dir_info": {}}
    assert install_command("hf", None, plain) == "pip install '/src/my clone[hf]'"
    wheel = tmp_path / "shardkit-0.1.0-py3-none-any.whl"
    wheel.write_bytes(b"")
    record = {"url": wheel.as_uri(), "archive_info": {}}
    assert install_command("xla", None, record) == f"pip install '{wheel}[xla]'"
    wheel.unlink()
    assert install_command("xla", None, record) == (
        "pip install '.[xla]' from a shardkit clone (you installed "
        "shardkit-0.1.0-py3-none-any.whl, which is gone)")


def test_only_an_index_install_gets_the_published_name():
    assert install_command("cuda", None, None) == "pip install 'shardkit[cuda]'"
    remote = {"url": "https://example.org/shardkit-0.1.0-py3-none-any.whl", "archive_info": {}}
    assert install_command("cuda", None, remote) == "pip install 'shardkit[cuda]'"


def test_this_checkout_is_what_the_tests_import():
    root = Path(shardkit.__file__).resolve().parent.parent
    assert pip_install_extra("xla") == f"pip install -e '{root}[xla]'"
