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
"""The library's shape rules, checked on the source: short functions, no import cycles, no
trace-time switches, and no tracked file that points outside the repository or carries
provenance instead of the library's own terms (log numbers, hosting labels, absolute paths)."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess

import pytest

pytestmark = pytest.mark.tooling

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


#: The scripts around the library: they use it through its public calls and arguments.
SCRIPTS = sorted(p for d in ("benchmarks", "examples", "scripts") for p in (ROOT / d).glob("*.py"))
_PACKAGES = ("dion3_jax", "pallas_kernels")


def _library_names(tree: ast.Module) -> set[str]:
    """The names a script binds to the library's modules and objects by importing them."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in node.names
                      if a.name.split(".")[0] in _PACKAGES}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in _PACKAGES:
            names |= {a.asname or a.name for a in node.names}
    return names


def _patches(tree: ast.Module, names: set[str]) -> list[str]:
    """``lib.x = ...`` (also in tuples, augmented or annotated) and ``setattr(lib, ...)``."""
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr"
              and node.args and isinstance(node.args[0], ast.Name)):
            targets = [ast.Attribute(value=node.args[0], attr="<setattr>")]
        for target in targets:
            for t in ast.walk(target):
                base = t
                while isinstance(base, ast.Attribute):
                    base = base.value
                if t is not base and isinstance(base, ast.Name) and base.id in names:
                    found.append(f"line {node.lineno}: {ast.unparse(t)}")
    return sorted(set(found))


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_script_patches_the_library(path):
    """Benchmarks and examples never assign to an attribute of a library module or object."""
    tree = ast.parse(path.read_text())
    assert not _patches(tree, _library_names(tree)), _patches(tree, _library_names(tree))


def test_the_patch_check_sees_patches():
    tree = ast.parse("import dion3_jax._polar as p\nfrom pallas_kernels import _api\n"
                     "import numpy as np\np._matmul = 1\na, _api.syrk = 1, 2\n"
                     "setattr(p, 'x', 0)\nnp.x = 1\n")
    found = _patches(tree, _library_names(tree))
    assert found == ["line 4: p._matmul", "line 5: _api.syrk", "line 6: p.<setattr>"], found


#: Provenance that belongs in git history, not in a tracked text, and pointers outside the
#: repository: (label, pattern, flags). Every tracked text file is scanned for each, this one
#: too: a bracketed letter keeps each pattern from matching its own spelling here.
PLACE_PATTERNS = [
    ("a work-log number", r"\bs[e]ssions?\W{1,3}\d", re.IGNORECASE),
    ("a work-log word", r"\bs[e]ssions?\b|\bag[e]nts?\b|\bd[e]vice tool\b", re.IGNORECASE),
    ("a benchmark-log id", r"\br[u]n [A-Z]{1,2}\d*\b", 0),
    ("a hosting label", r"nvid[i]a-h[12]00", re.IGNORECASE),
    ("a hosting term", r"\b(?:l[e]nt|l[e]nding)\b", re.IGNORECASE),
    ("a tool's output variable", r"\$\{?O[U]T\b", 0),
    ("a side install in a temporary folder", r"/t[m]p/t?site", 0),
    ("an absolute machine path", r"(?<![\w.~-])/(?:w[o]rk|r[o]ot|h[o]me)/", 0),
    ("a document outside the repository", r"DES[I]GN\.md|METH[O]D\.md|\.\./sh[a]red", 0),
]
#: One line each pattern must catch, spelled in pieces so that this file holds none of them.
PLACE_EXAMPLES = ["ses" + "sion: 3", "other ag" + "ents' runs", "r" + "un B12", "nvidia" + "-h200",
                  "a GPU was le" + "nt", "${" + "OUT}/x", "/tmp" + "/site", "/wo" + "rk/main",
                  "DESI" + "GN.md"]
#: Files exempt from the scan, each with its reason (none).
PLACE_ALLOWED: dict[str, str] = {}
#: Not text: skipped by suffix (any other file that does not decode as UTF-8 fails the scan).
BINARY_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".npz", ".npy", ".gz", ".tgz", ".zip",
                   ".whl", ".pdf", ".pkl")


def _tracked_text_files() -> dict[str, str]:
    """``{path: text}`` of every tracked file that is text, the allowed ones left out."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split("\0")
    texts = {}
    for f in files:
        path = ROOT / f
        if not f or f in PLACE_ALLOWED or f.endswith(BINARY_SUFFIXES) or not path.is_file():
            continue
        texts[f] = path.read_bytes().decode("utf-8")
    return texts


@pytest.fixture(scope="module")
def tracked_texts() -> dict[str, str]:
    return _tracked_text_files()


def test_each_place_pattern_catches_its_example():
    for (label, pattern, flags), example in zip(PLACE_PATTERNS, PLACE_EXAMPLES, strict=True):
        assert re.search(pattern, example, flags), (label, example)


def test_the_scan_sees_the_repository(tracked_texts):
    assert {"README.md", "docs/BENCHMARKS.md", "dion3_jax/__init__.py",
            "scripts/gpu_multi.sh"} <= set(tracked_texts)


@pytest.mark.parametrize("label, pattern, flags", PLACE_PATTERNS,
                         ids=[p[0] for p in PLACE_PATTERNS])
def test_no_tracked_file_names_the_place_it_was_made(tracked_texts, label, pattern, flags):
    """The project speaks of itself only: none of ``PLACE_PATTERNS`` in any tracked text."""
    regex = re.compile(pattern, flags)
    bad = [f"{f}:{n}: {line.strip()[:120]}" for f, text in sorted(tracked_texts.items())
           for n, line in enumerate(text.splitlines(), 1) if regex.search(line)]
    assert not bad, f"{label} ({pattern}) in {len(bad)} lines:\n" + "\n".join(bad)


#: A calendar date: the library's comments and docstrings keep reasons, and the dated
#: measurements behind them live in docs/.
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")


def test_the_library_carries_no_dated_measurements():
    files = subprocess.run(["git", "ls-files", "-z", "dion3_jax/*.py", "pallas_kernels/*.py"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout
    files = [f for f in files.split("\0") if f]
    assert len(files) > 20
    bad = [f"{f}:{n}: {line.strip()[:120]}" for f in files
           for n, line in enumerate((ROOT / f).read_text().splitlines(), 1) if DATE.search(line)]
    assert not bad, "\n".join(bad)
    assert DATE.search("# measured 2026-12-04 on one GPU") and not DATE.search("shape 2048-64")


LICENSE_HEADER = ("# Copyright 2026 The dion3_jax Authors.\n#\n"
                  '# Licensed under the Apache License, Version 2.0 (the "License");\n')


def _lacks_license_header(text: str) -> bool:
    body = text.split("\n", 1)[1] if text.startswith("#!") else text
    return not body.startswith(LICENSE_HEADER)


def test_every_source_file_starts_with_the_license_header():
    """Every tracked Python and shell file opens (after a ``#!`` line) with the Apache-2.0
    header of LICENSE."""
    files = subprocess.run(["git", "ls-files", "-z", "*.py", "*.sh", ".ci/run"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    files = [f for f in files if f and (ROOT / f).is_file()]
    assert len(files) > 100
    missing = [f for f in files if _lacks_license_header((ROOT / f).read_text())]
    assert not missing, missing


def test_the_header_check_sees_a_missing_header():
    assert _lacks_license_header('"""A module."""\n')
    assert _lacks_license_header("#!/usr/bin/env bash\nset -e\n")
    assert not _lacks_license_header("#!/usr/bin/env bash\n" + LICENSE_HEADER)
