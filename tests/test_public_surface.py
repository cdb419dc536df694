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
"""The public surface is pinned: a change to it must change this file too.

``dion3_jax.__all__``, the public submodules and their ``__all__`` are listed here exactly; no
other public name may appear; every public name is documented (a docstring that names each
parameter, and a mention in the README or docs/).
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import pkgutil
import re
import subprocess
import sys

import pytest

import dion3_jax

ROOT = pathlib.Path(__file__).resolve().parents[1]

TOP_LEVEL = (
    "DimensionNumbers",
    "MeshOptions",
    "Orthogonalizer",
    "ScaleByDion3State",
    "apply_if_finite",
    "default_param_labels",
    "dion3",
    "fold_momentum_scale",
    "make_orthogonalizer",
    "momentum_for_fraction",
    "muon",
    "normuon",
    "polar",
    "routing_table",
    "scale_by_dion3",
    "stack_replica_momenta",
    "synchronize_momentum",
    "transfer_learning_rate",
    "unstack_replica_momenta",
)
SUBMODULES = {
    "newton_schulz": (
        "COEFFICIENT_PRESETS",
        "autotune_restarts",
        "get_coefficients",
        "gram_newton_schulz",
        "restart_growth",
        "standard_newton_schulz",
    ),
    "routing": (
        "DEFAULT_HEAD_PATTERN",
        "DEFAULT_SCALAR_PATTERN",
        "DEFAULT_VECTOR_PATTERN",
    ),
}
#: Public names whose docstring is not this project's (optax's class, re-exported).
FOREIGN = {"DimensionNumbers"}
#: Public functions whose docstring does not yet name every parameter (an ``Args:`` section is
#: missing). Strict: once it is written, the test passes and this entry must go.
ARGS_MISSING: set[str] = set()   # names whose docstring still lacks its Args: section


def _public_names(module) -> set[str]:
    return {n for n in vars(module) if not n.startswith("_")}


def _every_public_object() -> dict[str, object]:
    """``{qualified name: object}`` of every name in ``__all__`` of the package and submodules."""
    out = {name: getattr(dion3_jax, name) for name in dion3_jax.__all__}
    for sub, names in SUBMODULES.items():
        module = importlib.import_module(f"dion3_jax.{sub}")
        out.update({f"{sub}.{n}": getattr(module, n) for n in names})
    return out


def test_top_level_names_are_pinned():
    assert dion3_jax.__all__ == TOP_LEVEL
    for name in TOP_LEVEL:
        assert getattr(dion3_jax, name) is not None, name


def test_the_package_has_no_other_public_name():
    """Only ``__all__`` and the public submodules (attributes once they are imported)."""
    assert _public_names(dion3_jax) <= set(TOP_LEVEL) | set(SUBMODULES)
    assert set(TOP_LEVEL) | set(SUBMODULES) <= set(dir(dion3_jax))


def test_public_submodules_are_pinned():
    found = {m.name for m in pkgutil.iter_modules(dion3_jax.__path__)
             if not m.name.startswith("_")}
    assert found == set(SUBMODULES)


@pytest.mark.parametrize("sub", sorted(SUBMODULES))
def test_submodule_names_are_pinned(sub):
    module = importlib.import_module(f"dion3_jax.{sub}")
    assert module.__all__ == SUBMODULES[sub]
    assert _public_names(module) == set(SUBMODULES[sub])
    assert getattr(dion3_jax, sub) is module


def test_submodules_load_on_first_access():
    """``import dion3_jax`` does not import them (``python -m dion3_jax.newton_schulz`` then
    runs its module once); ``dion3_jax.newton_schulz`` imports it."""
    code = ("import sys, dion3_jax; "
            "before = [m for m in ('dion3_jax.newton_schulz', 'dion3_jax.routing') "
            "if m in sys.modules]; "
            "print(before, dion3_jax.newton_schulz.__name__, dion3_jax.routing.__name__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.split() == ["[]", "dion3_jax.newton_schulz", "dion3_jax.routing"]
    with pytest.raises(AttributeError, match="no attribute 'restarts'"):
        dion3_jax.restarts  # noqa: B018


def _docs_text() -> str:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return "\n".join(f.read_text() for f in files)


@pytest.mark.parametrize("name", sorted(_every_public_object()))
def test_every_public_name_is_in_the_docs(name):
    """In a code span of the README or docs/; a submodule's names with the submodule named."""
    text = _docs_text()
    *sub, short = name.split(".")
    spans = re.findall(r"`([^`\n]+)`", text)
    assert any(re.search(rf"\b{re.escape(short)}\b", s) for s in spans), name
    if sub:
        assert f"dion3_jax.{sub[0]}" in text, sub


@pytest.mark.parametrize("name", sorted(_every_public_object()))
def test_every_public_object_is_documented(name, request):
    """A docstring; for a function, every parameter named in it (the ``Args:`` section); for a
    class of ours, an ``Attributes:`` section naming every field; a constant, in its module's
    docstring."""
    if name in ARGS_MISSING:
        request.applymarker(pytest.mark.xfail(strict=True, reason="no Args: section yet"))
    obj = _every_public_object()[name]
    *sub, short = name.split(".")
    if not (inspect.isfunction(obj) or inspect.isclass(obj)):   # a constant: in its module's
        module = importlib.import_module(f"dion3_jax.{sub[0]}")  # docstring
        assert re.search(rf"\b{short}\b", inspect.getdoc(module)), name
        return
    if name in FOREIGN:
        assert obj.__module__.split(".")[0] != "dion3_jax", name
        return
    doc = inspect.getdoc(obj)
    assert doc, name
    if inspect.isfunction(obj):
        params = list(inspect.signature(obj).parameters)
        assert not params or "Args:" in doc, name
    else:
        assert "Attributes:" in doc, name
        params = list(getattr(obj, "_fields", None) or
                      [f for f in getattr(obj, "__dataclass_fields__", {})])
    missing = [p for p in params if not re.search(rf"\b{p}\b", doc)]
    assert not missing, (name, missing)
