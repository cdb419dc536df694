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
"""Threefry-2x32 in plain uint32 adds, rotations and xors, for a kernel to hash counters itself.

``jax.random``'s hash is the primitive ``threefry2x32_p``, which no Pallas lowering takes. This
is the same function written with the elementwise ops a Pallas kernel lowers (a rotation is
``(x << r) | (x >> (32 − r))``): 20 rounds, a key injection after every four. Its reference is
:func:`pallas_kernels._stochastic_rounding.random_bits` (the primitive), which it matches bit
for bit (``tests/test_threefry.py``); ``pallas_kernels._row_stats_mosaic`` calls it on the
counter words of the elements of a block.

Reference: Salmon et al., `Parallel Random Numbers: As Easy as 1, 2, 3
<https://doi.org/10.1145/2063384.2063405>`_, 2011 (Threefry); jax's own unrolled form
(``jax._src.random.threefry2x32``).
"""

from __future__ import annotations

import jax
from jax import lax
import numpy as np

#: The rotation distances of the four rounds between key injections, alternating.
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))

#: Threefry's key-schedule parity constant.
_PARITY = 0x1BD11BDA


def _rotate_left(x: jax.Array, r: int) -> jax.Array:
    return lax.shift_left(x, np.uint32(r)) | lax.shift_right_logical(x, np.uint32(32 - r))


def threefry2x32(key0, key1, x0: jax.Array, x1: jax.Array) -> jax.Array:
    """The first output word of Threefry-2x32 of the counter ``(x0, x1)`` under the key
    ``(key0, key1)``.

    Args:
      key0: uint32 scalar (or array broadcastable against ``x0``), the key's first word.
      key1: uint32, the key's second word.
      x0: uint32 counter words (the ``hi`` of
        :func:`pallas_kernels._stochastic_rounding.random_bits`).
      x1: uint32 counter words shaped like ``x0`` (its ``lo``).

    Returns:
      uint32 shaped like ``x0``: ``threefry2x32_p(key0, key1, x0, x1)[0]``.

    Examples:
      >>> import jax.numpy as jnp
      >>> u = lambda v: jnp.asarray(v, jnp.uint32)
      >>> hex(int(threefry2x32(u(0), u(0), u(0), u(0))))     # the paper's test vector
      '0x6b200159'
    """
    ks = (key0, key1, key0 ^ key1 ^ np.uint32(_PARITY))
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = x0 ^ _rotate_left(x1, r)
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x0
