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
"""The ``Examples:`` sections of the public docstrings run and print what they say."""

import doctest
import importlib
import pkgutil

import pytest

import dion3_jax
import pallas_kernels

pytestmark = pytest.mark.tooling

_MODULES = sorted({f"{pkg.__name__}.{m.name}" for pkg in (dion3_jax, pallas_kernels)
                   for m in pkgutil.iter_modules(pkg.__path__)})


@pytest.mark.parametrize("name", _MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"


def test_examples_are_collected():
    """At least the polar and optimizer examples exist (the test above would pass on none)."""
    finder = doctest.DocTestFinder()
    for name in ("dion3_jax._polar", "dion3_jax._alias"):
        tests = finder.find(importlib.import_module(name))
        assert sum(len(t.examples) for t in tests) >= 3, name
