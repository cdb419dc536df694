"""The library's shape rules, checked on the source: short functions, no import cycles, no
trace-time switches, nothing that points outside the repository."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIBRARY = sorted((ROOT / "dion3_jax").glob("*.py"))
KERNELS = sorted((ROOT / "pallas_kernels").glob("*.py"))
MAX_CODE_LINES = 80


def _code_lines(fn: ast.FunctionDef, source: list[str]) -> int:
    """Lines of a function's body that hold code: no docstring, blank or comment-only lines."""
    body = fn.body
    if (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)):
        body = body[1:]
    if not body:
        return 0
    lines = source[body[0].lineno - 1:body[-1].end_lineno]
    return sum(1 for line in lines if line.strip() and not line.strip().startswith("#"))


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: p.name)
def test_no_library_function_is_longer_than_80_lines_of_code(path):
    source = path.read_text().splitlines()
    long = [(n.name, _code_lines(n, source)) for n in ast.walk(ast.parse("\n".join(source)))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and _code_lines(n, source) > MAX_CODE_LINES]
    assert not long, long


def _library_imports(path: pathlib.Path) -> tuple[set[str], list[str]]:
    """(module-level imports of dion3_jax modules, imports of them inside functions)."""
    tree = ast.parse(path.read_text())
    top, nested = set(), []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(
                "dion3_jax"):
            names = ([f"dion3_jax.{a.name}" for a in node.names] if node.module == "dion3_jax"
                     else [node.module])
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("dion3_jax")]
        mods = {n for n in names if n.split(".")[-1].startswith("_")}
        if node in tree.body:
            top |= mods
        elif mods:
            nested.extend(sorted(mods))
    return top, nested


def test_library_modules_import_each_other_without_cycles():
    graph = {}
    for path in LIBRARY:
        top, nested = _library_imports(path)
        assert not nested, f"{path.name} imports {nested} inside a function (a hidden cycle?)"
        graph[f"dion3_jax.{path.stem}"] = top
    state: dict[str, int] = {}

    def visit(mod, chain):
        if state.get(mod) == 1:
            raise AssertionError(f"import cycle: {' -> '.join(chain + [mod])}")
        if state.get(mod) == 2:
            return
        state[mod] = 1
        for dep in graph.get(mod, ()):
            visit(dep, chain + [mod])
        state[mod] = 2

    for mod in graph:
        visit(mod, [])


@pytest.mark.parametrize("path", LIBRARY + KERNELS, ids=lambda p: p.name)
def test_no_trace_time_switches_in_the_library(path):
    assert "contextvars" not in path.read_text(), path


def test_no_tracked_file_points_outside_the_repository():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    pattern = re.compile(r"DESIGN\.md|METHOD\.md|\.\./shared")
    bad = [f for f in files if f != "tests/test_code_shape.py" and (ROOT / f).suffix in (
        ".py", ".md", ".sh", ".txt", ".toml", "") and (ROOT / f).is_file()
        and pattern.search((ROOT / f).read_text(errors="ignore"))]
    assert not bad, bad
