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
"""The version is written once, as ``dion3_jax.__version__``; the packaging metadata reads it."""

from __future__ import annotations

import ast
import importlib.metadata
import pathlib
import re
import tomllib

import pytest

import dion3_jax

pytestmark = pytest.mark.tooling

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _literal_version() -> str:
    """``__version__`` as setuptools' ``attr:`` reads it without importing the package: a
    string literal assigned at the top level of ``dion3_jax/__init__.py``."""
    tree = ast.parse((ROOT / "dion3_jax" / "__init__.py").read_text())
    values = [node.value.value for node in tree.body if isinstance(node, ast.Assign)
              and [getattr(t, "id", None) for t in node.targets] == ["__version__"]
              and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)]
    assert len(values) == 1, "dion3_jax/__init__.py must assign __version__ one string literal"
    return values[0]


def test_pyproject_reads_the_version_from_the_package():
    project = PYPROJECT["project"]
    assert "version" not in project, "pyproject.toml writes the version itself"
    assert "version" in project["dynamic"]
    dynamic = PYPROJECT["tool"]["setuptools"]["dynamic"]
    assert dynamic["version"] == {"attr": "dion3_jax.__version__"}


def test_the_literal_is_the_imported_version():
    assert _literal_version() == dion3_jax.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", dion3_jax.__version__), dion3_jax.__version__


def test_changelog_top_entry_is_this_version():
    text = (ROOT / "CHANGELOG.md").read_text()
    top = re.search(r"^## \[([^\]]+)\]", text, flags=re.M).group(1)
    assert top == dion3_jax.__version__, (top, dion3_jax.__version__)


def test_installed_metadata_agrees():
    try:
        installed = importlib.metadata.version("dion3_jax")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("dion3_jax is not installed (a source checkout on the path)")
    assert installed == dion3_jax.__version__, (
        f"installed metadata says {installed}, dion3_jax.__version__ {dion3_jax.__version__}: "
        "reinstall (pip install -e .)")
