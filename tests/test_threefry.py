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
"""The Threefry-2x32 that kernels hash counters with (``pallas_kernels._threefry``), bit for bit
against its reference, jax's ``threefry2x32_p`` (through ``random_bits``), on fresh random keys
and counters, the counters' extremes and the published test vectors."""

import jax.numpy as jnp
import numpy as np

from pallas_kernels._stochastic_rounding import random_bits
from pallas_kernels._threefry import threefry2x32
from seeds import module_seed

#: Fresh random inputs per run, printed with every test (tests/seeds.py).
SEED = module_seed()


def _words(rng, shape) -> jnp.ndarray:
    return jnp.asarray(rng.integers(0, 2 ** 32, shape, dtype=np.uint64).astype(np.uint32))


def test_matches_the_primitive_on_random_keys_and_counters():
    rng = np.random.default_rng(SEED)
    for _ in range(4):
        key = _words(rng, (2,))
        hi, lo = _words(rng, (4096,)), _words(rng, (4096,))
        hi = hi.at[:4].set(jnp.asarray([0, 0xFFFFFFFF, 0, 0xFFFFFFFF], jnp.uint32))
        lo = lo.at[:4].set(jnp.asarray([0, 0, 0xFFFFFFFF, 0xFFFFFFFF], jnp.uint32))
        np.testing.assert_array_equal(np.asarray(threefry2x32(key[0], key[1], hi, lo)),
                                      np.asarray(random_bits(key, hi, lo)))


def test_known_answers():
    """Random123's known-answer vectors for Threefry-2x32 with 20 rounds (first word)."""
    u = lambda v: jnp.asarray(v, jnp.uint32)  # noqa: E731
    assert int(threefry2x32(u(0), u(0), u(0), u(0))) == 0x6B200159
    assert int(threefry2x32(u(0xFFFFFFFF), u(0xFFFFFFFF), u(0xFFFFFFFF),
                            u(0xFFFFFFFF))) == 0x1CB996FC
    assert int(threefry2x32(u(0x13198A2E), u(0x03707344), u(0x243F6A88),
                            u(0x85A308D3))) == 0xC4923A9C
