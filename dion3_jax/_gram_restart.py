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
"""A Gram Newton-Schulz restart formed from the first Gram matrix, with no pass over ``X``.

A restart of a wide ``n × m`` ``X`` sets ``X ← Q X`` and recomputes ``R = X Xᵀ``: ``n²m``
multiply-adds for the product and ``n²m / 2`` for the symmetric Gram matrix, ``1.5·r`` products
of ``n³`` at aspect ``r = m / n``. The new Gram matrix is also ``Q R₀ Qᵀ`` for the first one,
``R₀``, and the result then ``(Q₂ Q₁) X``: a cost that does not grow with ``m``. Its accuracy
is the point of a restart, which exists to drop the spurious negative eigenvalues that float16
rounding leaves in ``R`` (``dion3_jax/_restarts.py``), so each factor is kept to about 22 bits:

* ``R₀`` comes out of the Gram product in float32, and ``T = R₀ Qᵀ`` and ``Q T`` are each
  summed from the float16 halves of their float32 operand (``a·s ≈ hi + lo·2⁻¹²``, with ``s``
  a power of two per matrix that lifts the largest entry to ``[1/2, 1)``, so that the halves
  stay out of float16's subnormals and below its overflow): two products each, with float32
  accumulation;
* ``Q T`` is symmetric in exact arithmetic, so it runs as a symmetric product.

So a restart costs 3 products of ``n³`` (the two halves of ``T`` in full, the two of ``Q T``
symmetric), plus 1 for each composition ``Q₂ Q₁``: 4 against ``1.5·r`` with one restart, which
is cheaper from :data:`GRAM_RESTART_MIN_ASPECT` on. ``benchmarks/restart_form.py`` measures the
restarted ``R`` against float64: with both operands split its spectral error and most negative
eigenvalue match those of a fresh Gram matrix, while one float16 ``R₀`` leaves eigenvalues
ten times more negative and amplifies them (largest singular value of the polar up to 2.2).

A tall ``X`` (``R = Xᵀ X``, result ``X Q``) runs the transposed formulas: ``R ← Qᵀ R₀ Q`` and
``Q₁ Q₂``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import pallas_kernels

#: The aspect ratio (long side over short side) from which a restart from the first Gram matrix
#: needs fewer products than one from ``X``: ``1.5·r > 4``.
GRAM_RESTART_MIN_ASPECT = 8 / 3

#: The weight of the low half: ``a·s ≈ hi + lo·2⁻¹²``.
_LO = 2.0**-12


def _mm(a: jax.Array, b: jax.Array, out_dtype, transpose_b: bool = False) -> jax.Array:
    """Batched ``a @ b`` (``a @ bᵀ`` with ``transpose_b``) with float32 accumulation, rounded
    once to ``out_dtype``."""
    spec = "bik,bjk->bij" if transpose_b else "bik,bkj->bij"
    acc = jnp.promote_types(jnp.promote_types(a.dtype, b.dtype), jnp.float32)
    return jnp.einsum(spec, a, b, preferred_element_type=acc).astype(out_dtype)


def halves(a: jax.Array, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(hi, lo, s)`` with ``a·s ≈ hi + lo·2⁻¹²``: ``hi``, ``lo`` in ``dtype`` (16-bit),
    ``s`` a power of two per matrix (``(B, 1, 1)``) that brings ``max |a|`` into
    ``[1/2, 1)`` (1 for a zero matrix)."""
    peak = jnp.max(jnp.abs(a), axis=(-2, -1), keepdims=True)
    s = jnp.where(peak > 0, jnp.exp2(-jnp.floor(jnp.log2(jnp.where(peak > 0, peak, 1.0))) - 1),
                  1.0).astype(a.dtype)
    scaled = a * s
    hi = scaled.astype(dtype)
    return hi, ((scaled - hi.astype(a.dtype)) / _LO).astype(dtype), s


def compose(q: jax.Array, acc: jax.Array, tall: bool) -> jax.Array:
    """The accumulated factor after ``q``: ``q · acc`` for a wide ``X`` (``Q₂ Q₁ X``),
    ``acc · q`` for a tall one (``X Q₁ Q₂``), in ``q``'s dtype."""
    return _mm(acc, q, q.dtype) if tall else _mm(q, acc, q.dtype)


@functools.partial(jax.jit, static_argnames=("tall", "backend"))
def restarted_gram(acc: jax.Array, r0: jax.Array, tall: bool, backend) -> jax.Array:
    """``acc R₀ accᵀ`` (``accᵀ R₀ acc`` for a tall ``X``) in ``acc``'s dtype.

    Args:
      acc: ``(B, n, n)`` 16-bit, the factor accumulated since the start.
      r0: ``(B, n, n)`` float32 (float64 for a float64 ``acc``), the first Gram matrix
        (rescaled, if the iteration is).
      tall: whether ``X`` is tall (its Gram matrix is ``Xᵀ X``).
      backend: the symmetric product's ``pallas_kernels`` implementation.

    Returns:
      The Gram matrix of the restarted iterate, rounded once to ``acc.dtype``.
    """
    dtype, wide = acc.dtype, r0.dtype
    left = jnp.swapaxes(acc, -1, -2) if tall else acc   # R = left · R₀ · leftᵀ
    hi, lo, s = halves(r0, dtype)
    t = _mm(hi, left, wide, transpose_b=True) + _mm(lo, left, wide, transpose_b=True) * _LO
    t_hi, t_lo, s_t = halves(t, dtype)                  # t = s · R₀ leftᵀ
    # Neither half's product is symmetric, their sum is: the kernels compute the lower tiles
    # (and whole diagonal tiles) of α·a·b + β·c, reading c there only, and mirror them.
    p_lo = pallas_kernels.sym_matmul(left, t_lo, out_dtype=wide, implementation=backend)
    p = pallas_kernels.sym_matmul(left, t_hi, p_lo, alpha=1.0, beta=_LO, out_dtype=wide,
                                  implementation=backend)
    return (p / (s * s_t)).astype(dtype)
