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
"""benchmarks/_trace.py: device time from a profiler trace (hand-made planes; CPU: no GPU)."""

from __future__ import annotations

import pathlib
import sys
from types import SimpleNamespace as NS

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import _trace  # noqa: E402
from seeds import module_seed  # noqa: E402

pytestmark = pytest.mark.tooling

#: Fresh random inputs per run, printed with every test (tests/seeds.py).
SEED = module_seed()


def _line(name, durations):
    return NS(name=name, events=[NS(name=f"op{i}", duration_ns=d, start_ns=1000 * i)
                                 for i, d in enumerate(durations)])


def test_busy_time_sums_the_op_lines_only():
    rng = np.random.default_rng(SEED)
    ops, streams = rng.integers(1, 10**6, 5), rng.integers(1, 10**6, 3)
    summaries = [_line("XLA Modules", [10**9]), _line("Steps", [10**9])]
    # With an "XLA Ops" line, only it counts (stream lines repeat the same kernels).
    plane = NS(lines=summaries + [_line("XLA Ops", ops), _line("Stream #1", streams)])
    assert _trace.busy_ns(plane) == float(ops.sum())
    # Without one, every line but the summaries.
    plane = NS(lines=summaries + [_line("Stream #1", ops), _line("Stream #2", streams)])
    assert _trace.busy_ns(plane) == float(ops.sum() + streams.sum())


def test_first_gpu_picks_the_lowest_gpu_plane():
    planes = [NS(name="/host:CPU"), NS(name="/device:GPU:1"), NS(name="/device:GPU:0")]
    assert _trace.first_gpu(NS(planes=planes)).name == "/device:GPU:0"
    assert _trace.first_gpu(NS(planes=planes[:1])) is None


def test_device_ms_is_none_without_a_gpu():
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU's trace has a GPU plane")
    assert _trace.device_ms(jax.jit(lambda x: x + 1), jnp.ones(8), reps=2) is None
