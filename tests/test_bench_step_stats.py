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
"""bench_step.py's accounting: collective bytes per dtype from HLO text, and memory per device."""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_step  # noqa: E402
from seeds import module_seed  # noqa: E402

pytestmark = pytest.mark.tooling

#: Fresh random inputs per run, printed with every test (tests/seeds.py).
SEED = module_seed()


def test_collective_bytes_by_dtype_and_counts():
    rng = np.random.default_rng(SEED)
    a, b, c = (int(x) for x in rng.integers(1, 500, 3))
    hlo = "\n".join([
        f"  %x = f16[{a},64]{{1,0}} all-to-all(f16[{a},64]{{1,0}} %p), dimensions={{0}}",
        f"  %s = (f32[{b}], f32[{b}]) all-reduce-start(f32[{b}]{{0}} %q), to_apply=%add",
        f"  %d = f32[{b}] all-reduce-done((f32[{b}], f32[{b}]) %s)",
        f"  %g = bf16[{c},8]{{1,0}} all-gather(bf16[{c},4]{{1,0}} %r), dimensions={{1}}",
        "  %m = f32[8]{0} multiply(f32[8]{0} %u, f32[8]{0} %v)",
    ])
    assert bench_step.collective_bytes_by_dtype(hlo) == {"f16": 2 * 64 * a, "f32": 4 * b,
                                                         "bf16": 2 * 4 * c}
    stats = bench_step.collective_stats(hlo)
    assert stats["all-to-all"] == [1, 2 * 64 * a] and stats["all-reduce"] == [1, 4 * b]
    assert stats["all-gather"] == [1, 8 * c]


def test_memory_counts_the_state_on_the_first_device():
    params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros((32,), jnp.bfloat16)}
    tx = optax.adam(1e-3)
    state = tx.init(params)
    expect = 2 * (64 * 32 * 4 + 32 * 2) + 4     # mu, nu like the params; the int32 count
    step = jax.jit(lambda p, s, g: tx.update(g, s, p)).lower(params, state, params).compile()
    state_mib, temp_mib = bench_step.memory_mib(step, state)
    assert state_mib * 2**20 == expect
    assert temp_mib is None or temp_mib >= 0
