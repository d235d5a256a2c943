"""Examples that cannot drift: every Python and shell block in README.md and docs/ runs, or says why not.

A block's marker, an HTML comment on the line before its fence, says how it is checked:

- ``<!-- run: PRELUDE -->``: executed here, after the named prelude below (a sharded model at 2
  ranks, a small GPT, a LightningModule, ...); for ``plan-output`` the command runs and its
  output must equal the ``text`` block that follows it.
- ``<!-- same-as: PATH -->``: the block is that file, verbatim (and the file is run by a test).
- ``<!-- checked-by: PATH: TEXT -->``: TEXT is in the block and in PATH, the CI script or test
  that runs it (e.g. the test command, which .ci/run runs verbatim).
- ``<!-- not run: REASON -->``: not run, and the reason says why (two machines, a TPU, ...).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
CHECKED_LANGUAGES = {"python", "bash", "sh", "shell", "console"}
MARKER = re.compile(r"^<!--\s*(run|same-as|checked-by|not run):\s*(.*?)\s*-->$")


@dataclass(frozen=True)
class Block:
    """One fenced block of a Markdown file, with the marker that precedes it (if any)."""

    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    marker: str | None  # "run", "same-as", "checked-by", "not run"
    argument: str
    following_text: str | None  # the ```text block right after this one, if any

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _blocks(path: Path) -> list[Block]:
    lines = path.read_text().split("\n")
    found: list[Block] = []
    raw: list[tuple[int, str, str, str | None, str]] = []
    i = 0
    while i < len(lines):
        opening = re.match(r"^(\s*)```(\w*)\s*$", lines[i])
        if not opening:
            i += 1
            continue
        indent, language = opening.group(1), opening.group(2)
        end = i + 1
        while not re.match(r"^\s*```\s*$", lines[end]):
            end += 1
        code = textwrap.dedent("\n".join(line[len(indent):] if line.startswith(indent) else line
                                         for line in lines[i + 1:end])) + "\n"
        before = i - 1
        while before >= 0 and not lines[before].strip():
            before -= 1
        marked = MARKER.match(lines[before].strip()) if before >= 0 else None
        raw.append((i + 1, language, code, marked.group(1) if marked else None,
                    marked.group(2) if marked else ""))
        i = end + 1
    for n, (line, language, code, marker, argument) in enumerate(raw):
        nxt = raw[n + 1] if n + 1 < len(raw) else None
        following = nxt[2] if nxt and nxt[1] == "text" and nxt[3] is None else None
        found.append(Block(path, line, language, code, marker, argument, following))
    return found


BLOCKS = [b for path in DOC_FILES for b in _blocks(path) if b.language in CHECKED_LANGUAGES]
RUN_BLOCKS = [b for b in BLOCKS if b.marker == "run"]

# What a `run:` block finds already defined. Blocks run in each of 2 ranks (shardkit.spawn, gloo)
# unless the prelude's runner says otherwise.
# The quick start's Block (the pages' snippets are written against it).
_BLOCK_CLASS = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        return x + self.mlp(self.norm(x))
'''
_BLOCK_MODEL = _BLOCK_CLASS + '''

import shardkit

ctx = shardkit.current_context()
'''
PRELUDES = {
    "plain-model": _BLOCK_MODEL + '''
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), Block(32), Block(32), nn.Linear(32, 4))
''',
    "sharded-model": _BLOCK_MODEL + '''
torch.manual_seed(0)
model = shardkit.shard(nn.Sequential(nn.Linear(16, 32), Block(32), Block(32), nn.Linear(32, 4)),
                       auto_wrap_policy=shardkit.wrap.transformer_layers({Block}))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
torch.manual_seed(1 + ctx.rank)  # each rank draws its own batches
''',
    "elementwise": _BLOCK_MODEL + '''
torch.manual_seed(0)
model = shardkit.shard(nn.Sequential(nn.Linear(16, 32), Block(32), Block(32), nn.Linear(32, 4)),
                       auto_wrap_policy=shardkit.wrap.transformer_layers({Block}))
before = [p.full_tensor().clone() for p in model.parameters()]
''',
    "muon": _BLOCK_MODEL + '''
torch.manual_seed(0)
model = shardkit.shard(nn.Sequential(nn.Linear(16, 32), Block(32), nn.Linear(32, 4)),
                       auto_wrap_policy=shardkit.wrap.transformer_layers({Block}))
p = model[0].weight                      # this rank's rows of a (32, 16) matrix
momentum = torch.randn_like(p)           # optimizer state shaped like p
lr = 0.01
before = shardkit.full_tensor(p).clone()


def newton_schulz(g):
    return g / (g.norm() + 1e-7)          # stands in for the orthogonalisation


torch.set_grad_enabled(False)             # as inside optimizer.step()
''',
    "gpt": _BLOCK_MODEL + '''
class GPT(nn.Module):
    def __init__(self, width=32, layers=2):
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.h = nn.ModuleList(Block(width) for _ in range(layers))
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        for block in self.transformer.h:
            x = block(x)
        return self.head(x)


torch.manual_seed(0)
model = GPT()
''',
}
# Checks run after a block, in the same namespace: the block did what the page says.
EPILOGUES = {
    "elementwise": '''
from shardkit.sharding.surface.local_step import last_step_was_local
assert last_step_was_local(opt)   # the declared optimizer stepped the local tensors
assert all(not torch.equal(b, p.full_tensor()) for b, p in zip(before, model.parameters()))
''',
    "muon": '''
after = shardkit.full_tensor(p)
full_update = newton_schulz(shardkit.full_tensor(p, momentum))
assert torch.allclose(after, before - lr * full_update, atol=1e-6), (after - before).abs().max()
''',
    "gpt": '''
loss = model(torch.randn(2, 8, 32)).square().mean()
loss.backward()
assert all(p.grad is not None for p in model.parameters())
''',
}

_SPAWN_RUNNER = '''
import sys

import shardkit

PRELUDE = {prelude!r}
CODE = {code!r}
EPILOGUE = {epilogue!r}


def rank(local_rank):
    namespace = {{"__name__": "__doc_block__"}}
    exec(compile(PRELUDE, "<prelude>", "exec"), namespace)
    exec(compile(CODE, "{name}", "exec"), namespace)
    exec(compile(EPILOGUE, "<epilogue>", "exec"), namespace)


if __name__ == "__main__":
    shardkit.spawn(rank, 2, backend="cpu", threads_per_rank=1)
    print("doc block ran on 2 ranks")
'''

_LIGHTNING_RUNNER = _BLOCK_CLASS + '''
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), Block(16), nn.Linear(16, 2))

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, _):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


if __name__ == "__main__":
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    data = TensorDataset(x, (x[:, 0] > 0).long())
    model = Model()
    train_loader = DataLoader(data, batch_size=8)
    val_loader = DataLoader(data, batch_size=16)
    __CODE__
    if trainer.global_rank == 0:
        print("doc block fitted, val_loss", float(trainer.callback_metrics["val_loss"]))
'''

_PLUGIN_CHECK = '''
import shardkit
import shardkit_mydev

shardkit.register_plugin(shardkit_mydev)
status = {s.name: s for s in shardkit.backend_statuses()}["mydev"]
assert not status.available and "pip install shardkit-mydev" in status.hint, status
print("plugin registered:", status.name, "available:", status.available)
'''


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "SHARDKIT_BACKEND", "PJRT_DEVICE")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    return env


def _python(script: Path, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script)], cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=timeout)


def test_every_python_and_shell_block_is_run_or_says_why_not():
    assert len(BLOCKS) >= 20, [b.name for b in BLOCKS]
    unmarked = [b.name for b in BLOCKS if b.marker is None]
    assert not unmarked, f"blocks without a marker (see this file's docstring): {unmarked}"
    for block in BLOCKS:
        if block.marker == "not run":
            assert len(block.argument) > 15, f"{block.name}: say why it is not run"
        elif block.marker == "run":
            assert block.argument in (*PRELUDES, "lightning", "plan-output", "plugin-file",
                                      "conformance"), f"{block.name}: unknown prelude {block.argument!r}"
            if block.argument == "plan-output":
                assert block.following_text, f"{block.name}: plan-output needs the output after it"
        elif block.marker == "same-as":
            assert block.code == (ROOT / block.argument).read_text(), (
                f"{block.name} differs from {block.argument}")
        else:
            path, _, text = block.argument.partition(": ")
            assert text and text in block.code, f"{block.name}: {text!r} is not in the block"
            assert text in (ROOT / path).read_text(), f"{block.name}: {path} does not run {text!r}"


def test_a_broken_marker_is_caught(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n\n```python\nprint(1)\n```\n\n<!-- not run: a reason long enough -->\n"
                    "```bash\necho 2\n```\n```text\n2\n```\n")
    first, second, third = _blocks(page)
    assert first.marker is None and second.marker == "not run" and third.language == "text"
    assert second.following_text == "2\n"


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in RUN_BLOCKS if b.argument in PRELUDES
                                   and b.argument != "gpt"], ids=lambda b: b.name)
def test_python_block_runs_on_two_ranks(block, tmp_path):
    _run_on_two_ranks(block, tmp_path)


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("block", [b for b in RUN_BLOCKS if b.argument == "gpt"],
                         ids=lambda b: b.name)
def test_compile_block_runs_on_two_ranks(block, tmp_path):
    _run_on_two_ranks(block, tmp_path)


def _run_on_two_ranks(block: Block, tmp_path: Path) -> None:
    script = tmp_path / "doc_block.py"
    script.write_text(_SPAWN_RUNNER.format(prelude=PRELUDES[block.argument], code=block.code,
                                           epilogue=EPILOGUES.get(block.argument, ""),
                                           name=block.name))
    out = _python(script, tmp_path)
    assert out.returncode == 0 and "doc block ran on 2 ranks" in out.stdout, out.stdout + out.stderr


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("block", [b for b in RUN_BLOCKS if b.argument == "lightning"],
                         ids=lambda b: b.name)
def test_lightning_block_fits_at_two_devices(block, tmp_path):
    pytest.importorskip("lightning")
    code = block.code.replace("\n", "\n    ")
    script = tmp_path / "doc_block.py"
    script.write_text(_LIGHTNING_RUNNER.replace("__CODE__", code)
                      .replace("accumulate_grad_batches=2", "accumulate_grad_batches=2, max_epochs=2, "
                               "logger=False, enable_checkpointing=False, enable_progress_bar=False"))
    out = _python(script, tmp_path, timeout=600)
    assert out.returncode == 0 and "doc block fitted" in out.stdout, out.stdout + out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in RUN_BLOCKS if b.argument == "plan-output"],
                         ids=lambda b: b.name)
def test_plan_block_prints_what_the_page_shows(block, tmp_path):
    pytest.importorskip("transformers")
    command = block.code.replace("\\\n", " ").split()
    assert command[:2] == ["shardkit", "plan"], command
    out = subprocess.run([sys.executable, "-m", "shardkit", *command[1:]], cwd=tmp_path,
                         env=_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout == block.following_text, f"{block.name}: the page shows other output:\n{out.stdout}"


@pytest.mark.parametrize("block", [b for b in RUN_BLOCKS if b.argument == "plugin-file"],
                         ids=lambda b: b.name)
def test_plugin_file_registers_a_backend(block, tmp_path):
    (tmp_path / "shardkit_mydev.py").write_text(block.code)
    (tmp_path / "check.py").write_text(_PLUGIN_CHECK)
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT)])
    out = subprocess.run([sys.executable, "check.py"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "plugin registered: mydev" in out.stdout, out.stdout + out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in RUN_BLOCKS if b.argument == "conformance"],
                         ids=lambda b: b.name)
def test_conformance_block_runs_for_a_real_backend(block, tmp_path):
    # The page names the reader's backend; the cpu backend stands in for it here.
    assert '"mydev"' in block.code
    script = tmp_path / "doc_block.py"
    script.write_text(block.code.replace('"mydev"', '"cpu"') + 'print("conformance passed")\n')
    out = _python(script, tmp_path, timeout=600)
    assert out.returncode == 0 and "conformance passed" in out.stdout, out.stdout + out.stderr


def _anchor(heading: str) -> str:
    """The id mkdocs' toc extension gives a heading (and GitHub, for these headings)."""
    text = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"[\s]+", "-", text)


def test_readme_links_reach_pages_and_headings_that_exist():
    # mkdocs --strict checks the links between docs/ pages (.ci/lint); README.md is outside it.
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    local = [link for link in links if not re.match(r"^[a-z]+://", link)]
    assert len(local) >= 5, local
    for link in local:
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.is_file(), f"README links to {link}, which does not exist"
        if anchor:
            headings = re.findall(r"(?m)^#+\s+(.*)$", target.read_text())
            assert anchor in {_anchor(h) for h in headings}, f"README links to {link}: no such heading"


def test_the_built_site_works_opened_from_disk(tmp_path):
    # Issue 57: opened from disk (file://), every nav link of the built site showed a folder
    # listing: links ended in a folder (use_directory_urls). Every link between pages must name
    # a file that exists.
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    site = tmp_path / "site"
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--quiet", "--site-dir",
                            str(site)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert built.returncode == 0, built.stderr
    # 404.html is a server's page (its links start at the site's root), never opened from disk
    pages = sorted(p for p in site.rglob("*.html") if p.name != "404.html")
    assert len(pages) >= 20
    broken = []
    for page in pages:
        for link in re.findall(r'href="([^"#?]+)[^"]*"', page.read_text()):
            if re.match(r"^[a-z]+:|^//", link):
                continue  # another site (fonts, GitHub)
            target = (page.parent / link).resolve()
            if not target.is_file():
                broken.append(f"{page.relative_to(site)} -> {link}")
    assert not broken, broken[:10]
