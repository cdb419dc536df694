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
"""The seed of a test module's random inputs.

A module sets ``SEED = module_seed()`` and draws every random input from it
(``np.random.default_rng(SEED)``, ``jax.random.key(SEED)``, or ``SEED + i`` for the i-th of
several independent draws). Each run draws a fresh seed; ``tests/conftest.py`` prints it in the
output of every test of the module, which pytest shows when the test fails. To replay a failure,
set ``DION3_TEST_SEED`` to the printed value: every module then uses it.
"""

from __future__ import annotations

import os

import numpy as np

ENV_VAR = "DION3_TEST_SEED"


def module_seed() -> int:
    """``DION3_TEST_SEED`` if it is set, else a fresh seed in ``[0, 2**30)``."""
    value = os.environ.get(ENV_VAR, "").strip()
    if value:
        return int(value)
    return int(np.random.default_rng().integers(1 << 30))
