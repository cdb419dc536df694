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
"""The reference pages stay short: the README and docs/BENCHMARKS.md within their line bounds.

New material goes to the docs/ page of its topic, and measurements that a newer one replaces
leave docs/BENCHMARKS.md for its git history (CONTRIBUTING.md)."""

from __future__ import annotations

import pathlib

import pytest

pytestmark = pytest.mark.tooling

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: Each page and the most lines it may have.
BOUNDS = {"README.md": 300, "docs/BENCHMARKS.md": 400}


def excess(page: pathlib.Path, bound: int) -> str | None:
    """Why ``page`` breaks its bound (its line count), or None when it keeps it."""
    lines = len(page.read_text().splitlines())
    return f"{page.name} has {lines} lines, more than {bound}" if lines > bound else None


@pytest.mark.parametrize("path, bound", sorted(BOUNDS.items()))
def test_page_is_within_its_line_bound(path, bound):
    problem = excess(ROOT / path, bound)
    assert problem is None, f"{problem}: move material to the docs/ page of its topic"


def test_a_page_one_line_over_its_bound_is_caught(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("line\n" * 401)
    assert excess(page, 400) == "page.md has 401 lines, more than 400"
    page.write_text("line\n" * 400)
    assert excess(page, 400) is None
