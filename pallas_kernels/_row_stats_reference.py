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

from pallas_kernels._counter import RowCounter, counter_bits
from pallas_kernels._stochastic_rounding import STOCHASTIC_DTYPES, stochastic_round

#: The squares are of ``S·2⁻³²``: overflow-safe, as ``dion3_jax``'s norms take them.
DOWN = 2.0 ** -32


#: Where ``|S|`` saturates (:func:`scaled_sum`): 2⁷⁹ ≈ 6.0e23, so that a matrix of up to 2³⁴
#: entries has finite sums of ``(S·2⁻³²)²`` and a finite norm.
SATURATION = 2.0 ** 79


def _split_sum(scale: jax.Array, m: jax.Array, g: jax.Array) -> jax.Array:
    """``scale·M + G`` for a 16-bit ``M`` (in float32) as ``(hi·M + G) + lo·M``, ``scale = hi +
    lo`` cut after 12 significant bits: both products are exact (at most 12 + 11 significant
    bits, while above float32's normal range's bottom), so a compiler that contracts a product
    and a sum into one fused multiply-add (XLA on a CPU with FMA, or on a GPU) gets the same
    float32 as one that does not. ``scale·M + G`` itself would differ by one rounding between
    two such programs, and with it, rarely, the stochastic rounding of ``S``."""
    hi = lax.bitcast_convert_type(lax.bitcast_convert_type(scale, jnp.uint32)
                                  & np.uint32(0xFFFFF000), jnp.float32)
    lo = scale - hi
    return (hi * m + g) + lo * m


def scaled_sum(m: jax.Array, g: jax.Array, scale: jax.Array, bits: jax.Array | None = None,
               out_scale: jax.Array | None = None) -> jax.Array:
    """``S = scale ⊙ M + G`` in ``M``'s dtype, computed in float32 (``scale`` broadcasts
    against ``m``); where ``M`` and ``G`` are finite, ``S`` saturates at
    ``±min(SATURATION, finfo(M.dtype).max)`` (a sum past float32's range included), elsewhere
    the ``inf`` or NaN of a non-finite operand stays.

    ``out_scale`` (a float32 scalar, a power of two): ``S = out_scale·(scale ⊙ M + G)``,
    computed as ``(out_scale·scale) ⊙ M + out_scale·G`` (both products exact, unless they leave
    float32's range): a momentum stored in units of ``1/out_scale`` of the gradients' (a float16
    momentum's range, ``dion3_jax``'s step).

    ``bits`` (uint32, broadcastable to ``m``): for a bfloat16 or float16 ``M``, round ``S``
    stochastically with these random bits
    (:func:`pallas_kernels._stochastic_rounding.stochastic_round`); ignored for other dtypes,
    which round to nearest. Rounded stochastically, ``S`` is :func:`_split_sum`'s, the same
    float32 value in every program (a kernel's and XLA's), so that the same bits round it to
    the same 16-bit value."""
    dtype = m.dtype
    bound = np.float32(min(SATURATION, float(jnp.finfo(dtype).max)))
    stochastic = bits is not None and jnp.dtype(dtype) in STOCHASTIC_DTYPES
    m, g, scale = m.astype(jnp.float32), g.astype(jnp.float32), scale.astype(jnp.float32)
    if out_scale is not None:
        out_scale = jnp.asarray(out_scale, jnp.float32)
        g, scale = g * out_scale, scale * out_scale
    plain = scale * m + g
    s = _split_sum(scale, m, g) if stochastic else plain
    # Eight element ops, as a deep model's step runs this once per matrix; a NaN operand makes
    # ``s`` NaN, which both branches keep (``plain``: an ``inf`` times a zero ``lo`` of
    # :func:`_split_sum` would be NaN).
    finite = jnp.maximum(jnp.abs(m), jnp.abs(g)) < np.float32(np.inf)
    s = lax.select(finite, lax.clamp(-bound, s, bound), plain)
    if bits is None or not stochastic:
        return s.astype(dtype)
    return stochastic_round(s, dtype, bits)


def row_sums(s: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    x = s.astype(jnp.float32)
    zero = np.zeros((), np.float32)
    l1 = jax.lax.reduce(jnp.abs(x), zero, jax.lax.add, (axis,))
    sq = jax.lax.reduce(jax.lax.square(x * np.float32(DOWN)), zero, jax.lax.add, (axis,))
    return l1, sq


def accumulate_rows_reference(m: jax.Array, g: jax.Array, scale: jax.Array, *, row_axis: int,
                              bits: jax.Array | None = None, counter: RowCounter | None = None,
                              out_scale: jax.Array | None = None
                              ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The plain jnp form of :func:`accumulate_rows` (the ``"xla"`` implementation); a
    ``counter`` gives the bits :func:`pallas_kernels._counter.counter_bits` computes."""
    if counter is not None and jnp.dtype(m.dtype) in STOCHASTIC_DTYPES:
        bits = counter_bits(counter, m.shape, row_axis)
    s = scaled_sum(m, g, jnp.expand_dims(scale, 3 - row_axis), bits, out_scale)
    return (s, *row_sums(s, 3 - row_axis))
