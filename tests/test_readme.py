"""The README's Python snippets run as written; its first two commands are the scripts CI uses."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SNIPPETS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_readme_has_snippets():
    assert len(SNIPPETS) >= 3


@pytest.mark.parametrize("i", range(len(SNIPPETS)))
def test_snippet_runs(i):
    exec(compile(SNIPPETS[i], f"README.md[snippet {i}]", "exec"), {"__name__": "__readme__"})


def test_first_two_commands():
    bash_blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    commands = [line.split("#")[0].strip() for line in bash_blocks[0].splitlines()]
    commands = [c for c in commands if c]
    assert commands[:2] == ["bash scripts/train.sh", "bash scripts/test.sh"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash scripts/test.sh" in ci
    for c in commands[:2]:
        assert (ROOT / c.split()[1]).exists()
