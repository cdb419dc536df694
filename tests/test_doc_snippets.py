# Copyright 2026 The dion3_jax Authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
# ==============================================================================
"""Every fenced ```python block of the user-facing docs runs, on the CPU.

Collected: ``README.md``, ``docs/*.md`` and ``examples/README.md``. Each block runs on its own,
in a fresh namespace, so every block must import and define what it uses: a reader can copy any
one of them. Sketches that are not meant to run (signatures, pseudo-code) are fenced ```text
instead. A failure names the file and the line of the block's opening fence.

Blocks that take more than a few seconds on the 2-core CI machine are listed in ``SLOW`` (by a
piece of their text, so the entry survives edits around the block) and marked ``slow``.
"""

from __future__ import annotations

import contextlib
import pathlib
import re
import tempfile
from typing import NamedTuple

import jax
from jax.experimental.compilation_cache import compilation_cache
import pytest

pytestmark = pytest.mark.tooling

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC_GLOBS = ("README.md", "docs/*.md", "examples/README.md")
FENCE = re.compile(r"^```(\S*)[ \t]*$")

# (file, text that only that block contains): blocks that take more than a few seconds.
SLOW = {
    ("README.md", "nnx.Optimizer("),
    ("docs/HYPERPARAMETERS.md", "dion3_jax.apply_if_finite("),
}


class Block(NamedTuple):
    """One fenced block: the file relative to the repo root, its fence's line, language, code."""

    path: str
    line: int
    lang: str
    code: str


def extract_blocks(text: str, path: str) -> list[Block]:
    """Returns the fenced blocks of a Markdown text, in order.

    Args:
      text: the Markdown source.
      path: the file's name, stored in each block.

    Returns:
      One :class:`Block` per fenced block; ``line`` is the 1-based line of its opening fence and
      ``lang`` the word after the backticks (``""`` when there is none).

    Raises:
      ValueError: when a fence is never closed.
    """
    blocks, open_at, lang, body = [], None, "", []
    for number, line in enumerate(text.splitlines(), start=1):
        match = FENCE.match(line)
        if open_at is None and match:
            open_at, lang, body = number, match.group(1), []
        elif open_at is not None and line.rstrip() == "```":
            blocks.append(Block(path, open_at, lang, "\n".join(body) + "\n"))
            open_at = None
        elif open_at is not None:
            body.append(line)
    if open_at is not None:
        raise ValueError(f"{path}:{open_at}: fence never closed")
    return blocks


def doc_files() -> list[pathlib.Path]:
    """The collected Markdown files, sorted, without duplicates."""
    files = {p for pattern in DOC_GLOBS for p in ROOT.glob(pattern)}
    return sorted(files)


def python_blocks() -> list[Block]:
    """Every ```python block of :func:`doc_files`."""
    blocks = []
    for file in doc_files():
        rel = file.relative_to(ROOT).as_posix()
        blocks += [b for b in extract_blocks(file.read_text(), rel) if b.lang == "python"]
    return blocks


def _param(block: Block):
    slow = any(path == block.path and text in block.code for path, text in SLOW)
    marks = [pytest.mark.slow] if slow else []
    return pytest.param(block, id=f"{block.path}:{block.line}", marks=marks)


BLOCKS = python_blocks()


@contextlib.contextmanager
def jax_options_restored():
    """Puts back every jax option changed inside (and drops jax's handle on a persistent
    compilation cache that was turned on)."""
    before = dict(jax.config.values)
    try:
        yield
    finally:
        changed = [k for k, v in before.items() if jax.config.values.get(k) != v]
        for name in changed:
            jax.config.update(name, before[name])
        if any("cache" in name for name in changed):
            compilation_cache.reset_cache()


@pytest.fixture
def block_sandbox(tmp_path, monkeypatch):
    """A block may set process-wide jax options: TRAINING.md's turns on the persistent
    compilation cache in ``tempfile.gettempdir()``. Each block gets its test's own temporary
    directory, and its jax options are put back after it, so the later tests of the same
    process neither write their compiles to that cache nor read another run's from it."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with jax_options_restored():
        yield


@pytest.mark.usefixtures("block_sandbox")
@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS])
def test_python_block_runs(block: Block):
    """The block runs as written, in a fresh namespace (``__name__`` is not ``"__main__"``)."""
    # Blank lines in front, so that a traceback gives the line number in the Markdown file.
    code = compile("\n" * block.line + block.code, str(ROOT / block.path), "exec")
    exec(code, {"__name__": "__doc_snippet__"})


def test_readme_blocks_are_collected():
    """README.md's quickstart blocks are found (the test above would pass on none)."""
    readme = [b for b in BLOCKS if b.path == "README.md"]
    assert len(readme) >= 4
    assert any("dion3_jax.dion3(" in b.code for b in readme)


def test_slow_entries_match_a_block():
    """Every SLOW entry still names a block (a stale entry would silently mark nothing)."""
    for path, text in SLOW:
        assert any(b.path == path and text in b.code for b in BLOCKS), (path, text)


def test_extract_blocks_lines_and_languages():
    text = "intro\n```python\nx = 1\n```\n\n```text\nsketch(...)\n```\n```\nout\n```\n"
    blocks = extract_blocks(text, "t.md")
    assert [(b.line, b.lang, b.code) for b in blocks] == [
        (2, "python", "x = 1\n"), (6, "text", "sketch(...)\n"), (9, "", "out\n")]


def test_extract_blocks_rejects_an_unclosed_fence():
    with pytest.raises(ValueError, match="t.md:1"):
        extract_blocks("```python\nx = 1\n", "t.md")


def test_a_blocks_jax_options_are_put_back(tmp_path):
    """What TRAINING.md's block sets (a persistent compilation cache) is unset after it."""
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    before = [jax.config.values[n] for n in names]
    with jax_options_restored():
        jax.config.update(names[0], str(tmp_path))
        jax.config.update(names[1], 0.0)
        assert [jax.config.values[n] for n in names] != before
    assert [jax.config.values[n] for n in names] == before
