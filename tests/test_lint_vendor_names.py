"""shardkit/ never names a vendor: vendor code lives only in backends/<name>/."""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "shardkit"

# The collective libraries as words (underscores separate), so "accelerator" does not trip it.
VENDOR_PATTERN = re.compile(r"torch\.cuda|torch\.xpu|torch_xla|\.cuda\("
                            r"|(?<![A-Za-z0-9])(?:nccl|xccl|ccl|oneccl)(?![A-Za-z0-9])",
                            re.IGNORECASE)


def vendor_names(text: str) -> list[tuple[int, str]]:
    """Return (line number, matched text) for every vendor name in `text`."""
    return [(lineno, m.group(0)) for lineno, line in enumerate(text.splitlines(), 1)
            for m in VENDOR_PATTERN.finditer(line)]


def package_files() -> list[Path]:
    """Every text file under shardkit/ (compiled caches excluded)."""
    return sorted(p for p in PACKAGE.rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")


def test_checker_flags_each_vendor_name() -> None:
    """The checker finds every forbidden spelling, with its line number."""
    sample = "\n".join([
        "import torch",
        "ok = torch.cuda.is_available()",
        "x = torch.xpu.device_count()",
        "import torch_xla.core.xla_model as xm",
        "t = t.cuda()",
        'backend = "nccl"',
        "pg = 'xccl'",
        "# needs CCL bindings",
        "import oneccl_bindings_for_pytorch",
        "backend = 'oneCCL'",
    ])
    assert [line for line, _ in vendor_names(sample)] == list(range(2, 11))


def test_checker_ignores_ordinary_words() -> None:
    """Words that merely contain the letters are not vendor names."""
    assert vendor_names("accelerator cclass succlent cuda_like = device.type\nbackend.gloo") == []


def test_package_names_no_vendor() -> None:
    """No file in shardkit/ mentions a vendor API, library or backend string."""
    files = package_files()
    assert any(p.name == "backend.py" for p in files)  # the scan really looks at the package
    hits = [f"{path.relative_to(PACKAGE.parent)}:{line}: {text}"
            for path in files
            for line, text in vendor_names(path.read_text(encoding="utf-8", errors="replace"))]
    assert not hits, "vendor names in shardkit/ (move this code to backends/<name>/):\n" + "\n".join(hits)
