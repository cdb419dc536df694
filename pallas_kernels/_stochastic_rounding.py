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
"""Stochastic rounding of float32 to bfloat16 and float16, with counter-based random bits.

A 16-bit momentum that sums many gradients loses the small ones under round-to-nearest: once
``|M|`` is large, ``M + G`` rounds back to ``M`` every time. Rounding up with probability equal to
the distance to the lower neighbour (in units of the gap between the two) makes each rounding
unbiased, ``E[round(x)] = x``, so the sum's error is a zero-mean random walk instead of a drift.

The random bits are a pure function of a 64-bit key and an element's two index words
(:func:`random_bits`: :func:`pallas_kernels._counter_hash.counter_hash`, two MurmurHash3
finalizers per element), so that a kernel can produce the same bits from the indices of the
elements it holds.

Reference: Gupta et al., `Deep Learning with Limited Numerical Precision
<https://arxiv.org/abs/1502.02551>`_, 2015 (stochastic rounding of accumulations).
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._counter_hash import counter_hash

#: The dtypes :func:`stochastic_round` rounds to.
STOCHASTIC_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def random_bits(key: jax.Array, hi: jax.Array, lo: jax.Array) -> jax.Array:
    """32 random bits per element: the counter hash of ``(hi, lo)`` under ``key``
    (:func:`pallas_kernels._counter_hash.counter_hash`).

    Args:
      key: ``(2,)`` uint32, the key's two words.
      hi: uint32 counter words (e.g. an element's row-major index over all but the last axis).
      lo: uint32 counter words broadcastable against ``hi`` (e.g. its index along the last
        axis); a lower-rank word is hashed once per value.

    Returns:
      uint32 bits of the broadcast shape of ``hi`` and ``lo``; each element's depend on its own
      ``(hi, lo)`` only.
    """
    key = jnp.asarray(key).astype(jnp.uint32)
    return counter_hash(key[0], key[1], jnp.asarray(hi).astype(jnp.uint32),
                        jnp.asarray(lo).astype(jnp.uint32))


def _bfloat16(x: jax.Array, bits: jax.Array) -> jax.Array:
    """bfloat16 keeps float32's upper 16 bits: add 16 random bits below them and truncate (a
    carry rounds the magnitude up); a finite value that would carry into ``inf`` saturates."""
    u = lax.bitcast_convert_type(x, jnp.uint32)
    top = (u + (bits >> 16)) >> 16
    sign, mag = top & np.uint32(0x8000), top & np.uint32(0x7FFF)
    top = sign | jnp.minimum(mag, np.uint32(0x7F7F))          # 0x7F7F: bfloat16's max
    return lax.bitcast_convert_type(top.astype(jnp.uint16), jnp.bfloat16)


def _float16(x: jax.Array, bits: jax.Array) -> jax.Array:
    """float16: ``|x|`` (saturated at 65504) in units of float16's gap at ``|x|`` (a power of
    two, so the scaling is exact), floor, plus one with probability equal to the fraction."""
    a = jnp.minimum(jnp.abs(x), np.float32(65504.0))
    e = (lax.bitcast_convert_type(a, jnp.uint32) >> 23).astype(jnp.int32) - 127
    gap = jnp.maximum(e, -14) - 10                              # log2 of the gap, in [-24, 5]
    scale_down = lax.bitcast_convert_type(((127 - gap) << 23).astype(jnp.uint32), jnp.float32)
    scale_up = lax.bitcast_convert_type(((127 + gap) << 23).astype(jnp.uint32), jnp.float32)
    q = a * scale_down
    low = q.astype(jnp.int32).astype(jnp.float32)              # floor: q is in [0, 2¹¹]
    uniform = (bits >> 8).astype(jnp.float32) * np.float32(2.0 ** -24)
    y = jnp.where(q - low > uniform, low + np.float32(1.0), low) * scale_up
    # ``y ≥ 0`` takes ``x``'s sign bit (``copysign``, in ops that the Mosaic GPU kernels lower).
    sign = lax.bitcast_convert_type(x, jnp.uint32) & np.uint32(0x80000000)
    y = lax.bitcast_convert_type(lax.bitcast_convert_type(y, jnp.uint32) | sign, jnp.float32)
    return y.astype(jnp.float16)


def stochastic_round(x: jax.Array, dtype, bits: jax.Array) -> jax.Array:
    """``x`` rounded to ``dtype`` (bfloat16 or float16) up or down at random, unbiased.

    Each finite element becomes one of its two neighbours in ``dtype`` (itself when it is one),
    the upper with probability ``(x − lower) / (upper − lower)``, quantized to 2⁻¹⁶ (bfloat16)
    or 2⁻²⁴ (float16) of the gap. Magnitudes past ``dtype``'s largest finite value saturate
    there (float16: ±65504); ``inf`` and NaN stay what they are; signs (``-0.0`` too) are kept.

    Args:
      x: float32 values (other floating dtypes are cast to float32 first).
      dtype: bfloat16 or float16.
      bits: uint32 random bits broadcastable to ``x`` (:func:`random_bits`).

    Returns:
      ``x`` in ``dtype``.

    Raises:
      ValueError: for a ``dtype`` other than bfloat16 and float16.

    Examples:
      >>> import jax.numpy as jnp
      >>> x = jnp.full((2,), 1.0 + 2.0 ** -9)         # halfway between two bfloat16 values
      >>> bits = jnp.array([0, 0xFFFFFFFF], jnp.uint32)
      >>> stochastic_round(x, jnp.bfloat16, bits).tolist()
      [1.0, 1.0078125]
    """
    dtype = jnp.dtype(dtype)
    if dtype not in STOCHASTIC_DTYPES:
        raise ValueError(f"stochastic rounding is to bfloat16 or float16, got {dtype=}")
    x = jnp.asarray(x).astype(jnp.float32)
    bits = jnp.broadcast_to(jnp.asarray(bits, jnp.uint32), x.shape)
    rounded = _bfloat16(x, bits) if dtype == jnp.bfloat16 else _float16(x, bits)
    # (``|x| < inf`` is ``isfinite``, in an op that the Mosaic GPU kernels lower too.)
    return jnp.where(jnp.abs(x) < np.float32(np.inf), rounded, x.astype(dtype))
