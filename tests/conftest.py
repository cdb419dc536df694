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
import os
import sys

# Make tests/ helpers (dion3_reference) importable and keep the repo root first on the path.
sys.path.insert(0, os.path.dirname(__file__))

# XLA compiles with most of its optimizations off (`jax_disable_most_optimizations`): the
# suite's time is mostly XLA:CPU compiling small optimizer steps, which this cuts by about a
# third, and every numerical test compares against a float64 reference or another compiled
# step, not against one compiler's bits. tests/test_golden_step.py, whose data holds the bits
# of default compiles, turns them back on. Set in the environment, so the scripts that tests
# start as subprocesses inherit it; JAX_DISABLE_MOST_OPTIMIZATIONS=0 keeps them on.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

# The distributed tests need several devices; 8 simulated CPU devices are harmless for the
# single-device tests (they use device 0). Must run before any backend use.
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402

from platform_setup import on_platform  # noqa: E402
from seeds import ENV_VAR  # noqa: E402


@pytest.fixture
def default_xla_optimizations():
    """XLA's default optimizations for one test (the suite turns most of them off, above)."""
    before = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", False)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


@pytest.fixture
def on_test_platform():
    """See platform_setup.on_platform (used by the distributed test modules)."""
    with on_platform():
        yield


@pytest.fixture(autouse=True)
def print_module_seed(request):
    """A module that draws fresh inputs from a module-level ``SEED`` (``seeds.module_seed``)
    gets it printed in every test's output, so a failure's captured output names the inputs it
    failed on and how to draw them again."""
    seed = getattr(request.module, "SEED", None)
    if seed is not None:
        print(f"{request.module.__name__}.SEED = {seed} (replay: {ENV_VAR}={seed})")


#: Set to 1 to keep every parameter set of a parametrized test out of the slow set (``.ci/run``
#: does for its fast loop on the upper end of the version range).
EVERY_CASE_VAR = "DION3_FAST_LOOP_EVERY_CASE"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The fast loop runs each parametrized test once: the first of its parameter sets that is
    not marked ``slow``; the later ones are marked ``slow`` here, so the full suite runs them
    all and ``-m "not slow"`` one of each (unless ``DION3_FAST_LOOP_EVERY_CASE=1``). Runs
    before ``-m`` deselects, and every xdist worker collects the same items in the same order,
    so each worker marks the same cases."""
    if os.environ.get(EVERY_CASE_VAR) == "1":
        return
    kept = set()
    for item in items:
        if getattr(item, "callspec", None) is None or item.get_closest_marker("slow"):
            continue
        key = (item.path, item.cls, item.originalname)
        if key in kept:
            item.add_marker(pytest.mark.slow)
        else:
            kept.add(key)
