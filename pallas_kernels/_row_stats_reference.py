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
"""The plain jnp form of the statistics pass (:func:`pallas_kernels.accumulate_rows`): ``S = d ⊙
M + G`` with each row's ℓ1 norm and scaled sum of squares.

This is the ``"xla"`` implementation and the reference the kernels
(:mod:`pallas_kernels._row_stats_triton`, :mod:`pallas_kernels._row_stats_mosaic`) are tested
against;
:func:`scaled_sum` is also the kernels' own elementwise body.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._stochastic_rounding import STOCHASTIC_DTYPES, stochastic_round

#: The squares are of ``S·2⁻³²``: overflow-safe, as ``dion3_jax``'s norms take them.
DOWN = 2.0 ** -32


#: Where ``|S|`` saturates (:func:`scaled_sum`): 2⁷⁹ ≈ 6.0e23, so that a matrix of up to 2³⁴
#: entries has finite sums of ``(S·2⁻³²)²`` and a finite norm.
SATURATION = 2.0 ** 79


def scaled_sum(m: jax.Array, g: jax.Array, scale: jax.Array, bits: jax.Array | None = None
               ) -> jax.Array:
    """``S = scale ⊙ M + G`` in ``M``'s dtype, computed in float32 (``scale`` broadcasts
    against ``m``); where ``M`` and ``G`` are finite, ``S`` saturates at
    ``±min(SATURATION, finfo(M.dtype).max)`` (a sum past float32's range included), elsewhere
    the ``inf`` or NaN of a non-finite operand stays.

    ``bits`` (uint32, broadcastable to ``m``): for a bfloat16 or float16 ``M``, round ``S``
    stochastically with these random bits
    (:func:`pallas_kernels._stochastic_rounding.stochastic_round`); ignored for other dtypes,
    which round to nearest."""
    dtype = m.dtype
    bound = np.float32(min(SATURATION, float(jnp.finfo(dtype).max)))
    m, g = m.astype(jnp.float32), g.astype(jnp.float32)
    s = scale.astype(jnp.float32) * m + g
    # Eight element ops, as a deep model's step runs this once per matrix; a NaN operand makes
    # ``s`` NaN, which both branches keep.
    finite = jnp.maximum(jnp.abs(m), jnp.abs(g)) < np.float32(np.inf)
    s = lax.select(finite, lax.clamp(-bound, s, bound), s)
    if bits is None or jnp.dtype(dtype) not in STOCHASTIC_DTYPES:
        return s.astype(dtype)
    return stochastic_round(s, dtype, bits)


def row_sums(s: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    x = s.astype(jnp.float32)
    zero = np.zeros((), np.float32)
    l1 = jax.lax.reduce(jnp.abs(x), zero, jax.lax.add, (axis,))
    sq = jax.lax.reduce(jax.lax.square(x * np.float32(DOWN)), zero, jax.lax.add, (axis,))
    return l1, sq


def accumulate_rows_reference(m: jax.Array, g: jax.Array, scale: jax.Array, *, row_axis: int,
                              bits: jax.Array | None = None
                              ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The plain jnp form of :func:`accumulate_rows` (the ``"xla"`` implementation)."""
    s = scaled_sum(m, g, jnp.expand_dims(scale, 3 - row_axis), bits)
    return (s, *row_sums(s, 3 - row_axis))
