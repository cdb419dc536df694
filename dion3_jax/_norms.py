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
"""Overflow-safe Euclidean norms at the cost of one multiply per entry.

Squaring a float32 above about 1.8e19 overflows, so a plain ``√(Σ x²)`` of a large but finite
gradient is ``inf`` and the normalized polar input ``X / ‖X‖`` becomes exactly zero: a silently
zero update. Here the squares are taken of ``x · 2⁻³²`` and the root is scaled back by ``2³²``.
A power of two changes no rounding, so the norm is bitwise the plain one unless some entry is
below ``2⁻³¹`` (≈ 4.7e-10) in magnitude; such entries are then dropped from the sum, which only
matters for a whole matrix (or row) whose norm is itself tiny, below the ``1e-7`` the polar adds
to its norm anyway. Norms up to about 7e28 are finite; beyond that the norm is NaN, never
``inf`` (never a silently zero quotient). The step does not get there: its summed momentum
saturates at ``±2⁷⁹`` (``pallas_kernels.scaled_sum``), so the norm of any matrix of up to 2³⁴
entries is below 2⁹⁶ and finite, and a finite gradient gives a finite update and state. (A NaN
here would not be caught by ``apply_if_finite``: it checks the gradients it is given.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_DOWN = 2.0 ** -32
_UP = 2.0 ** 32


def total(x: jax.Array, axis) -> jax.Array:
    """``jnp.sum(x, axis)`` (``axis``: an int or a tuple) in ``x``'s dtype, as the same single
    ``lax`` reduction but cheaper to trace (``jnp.sum`` traces a nested jit per call, and the
    step sums per matrix)."""
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    return jax.lax.reduce(x, np.zeros((), x.dtype), jax.lax.add,
                          tuple(a % x.ndim for a in axes))


def sq_sum(x: jax.Array, axis) -> jax.Array:
    """``Σ (x·2⁻³²)²`` over ``axis``, in ``x``'s dtype (float32 or wider)."""
    return total(jax.lax.square(x * np.asarray(_DOWN, x.dtype)), axis)


def norm_from_sq_sum(s: jax.Array) -> jax.Array:
    """The norm from :func:`sq_sum`; NaN where it overflows."""
    n = jnp.sqrt(s) * jnp.asarray(_UP, s.dtype)
    return jax.lax.select(jnp.abs(n) == jnp.inf, jnp.full_like(n, jnp.nan), n)


def norm(x: jax.Array, axis, keepdims: bool = False) -> jax.Array:
    """Euclidean norm of ``x`` over ``axis`` without overflow (see the module docstring)."""
    out = norm_from_sq_sum(sq_sum(x, axis))
    return jnp.expand_dims(out, axis) if keepdims else out


def total_in_value_order(x: jax.Array, axis: int) -> jax.Array:
    """:func:`total` of ``x`` sorted along ``axis``: the sum depends on the terms alone, not on
    their order, so devices that hold the same terms in another order get the same bits (a
    float32 sum's last bit depends on its order, and the float16 polar can turn one ulp of its
    input's norm into a 1e-2 change of its output)."""
    return total(jnp.sort(x, axis=axis), axis)


def total_in_fixed_order(x: jax.Array, axis: int) -> jax.Array:
    """:func:`total` over ``axis`` as a pairwise tree of elementwise adds: ``axis`` is padded
    with zeros to a power of two, then its two halves are added until one entry is left.

    Each sum's bits depend on its terms and their positions along ``axis`` alone, not on the
    array's other dimensions: XLA reduces a ``(64, 16)`` and a ``(64, 128)`` array in
    different orders, so a row's plain sum can differ in its last bit between a device's
    shard and the whole matrix, but it does not reassociate elementwise adds. As many adds
    as a sum in any order (and the padding's), which XLA fuses (on the CPU: one read of the
    input and one of a quarter of it).
    """
    axis %= x.ndim
    size = 1 << max(0, (x.shape[axis] - 1).bit_length())
    if size != x.shape[axis]:
        pads = [(0, 0, 0)] * x.ndim
        pads[axis] = (0, size - x.shape[axis], 0)
        x = jax.lax.pad(x, np.zeros((), x.dtype), pads)
    while size > 1:
        size //= 2
        x = (jax.lax.slice_in_dim(x, 0, size, axis=axis)
             + jax.lax.slice_in_dim(x, size, 2 * size, axis=axis))
    return jnp.squeeze(x, axis)


def sq_sum_in_fixed_order(x: jax.Array, axis: int) -> jax.Array:
    """:func:`sq_sum` over ``axis`` added by :func:`total_in_fixed_order`."""
    return total_in_fixed_order(jax.lax.square(x * np.asarray(_DOWN, x.dtype)), axis)
