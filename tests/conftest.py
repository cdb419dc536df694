import os
import sys

# Make tests/ helpers (dion3_reference) importable and keep the repo root first on the path.
sys.path.insert(0, os.path.dirname(__file__))

# The distributed tests need several devices; 8 simulated CPU devices are harmless for the
# single-device tests (they use device 0). Must run before any backend use.
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402

from platform_setup import on_platform  # noqa: E402


@pytest.fixture
def on_test_platform():
    """See platform_setup.on_platform (used by the distributed test modules)."""
    with on_platform():
        yield


@pytest.fixture(autouse=True)
def print_module_seed(request):
    """A module that draws fresh inputs from a module-level ``SEED`` gets it printed in every
    test's output, so a failure's captured output names the inputs it failed on."""
    seed = getattr(request.module, "SEED", None)
    if seed is not None:
        print(f"{request.module.__name__}.SEED = {seed}")
