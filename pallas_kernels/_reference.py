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
"""Plain jnp references for the symmetric products (the truth the kernels are tested against).

Both kernels (:mod:`pallas_kernels._mosaic`, :mod:`pallas_kernels._triton`) compute these same
two products, so they share this one reference module: each imports it and re-exports the two
functions beside its own. They are also the ``"xla"`` implementation of :mod:`pallas_kernels`.

Both functions accumulate in float32 (float64 for float64 inputs) and round once to the output
dtype, which is what the kernels do as well.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _acc_dtype(dtype) -> jnp.dtype:
    # float32 for 16-bit and float32 inputs; float64 stays float64 (used by the exactness tests).
    return jnp.promote_types(dtype, jnp.float32)


def syrk_reference(x: jax.Array, *, transpose: bool = False, out_dtype=None) -> jax.Array:
    """Returns ``x @ xᵀ`` (or ``xᵀ @ x``) over the last two axes, batched over leading axes.

    Args:
      x: array of shape ``(..., n, m)``.
      transpose: return ``xᵀ @ x``, of shape ``(..., m, m)`` (BLAS ``syrk`` with ``trans='T'``).
      out_dtype: output dtype; defaults to ``x.dtype``.

    Returns:
      The ``(..., n, n)`` Gram matrix (``(..., m, m)`` with ``transpose``), accumulated in
      float32.
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    spec = "...ki,...kj->...ij" if transpose else "...ik,...jk->...ij"
    acc = jnp.einsum(spec, x, x, preferred_element_type=_acc_dtype(x.dtype))
    return acc.astype(out_dtype)


def sym_matmul_reference(a, b, c=None, *, alpha=1.0, beta=0.0, out_dtype=None) -> jax.Array:
    """Returns ``alpha * a @ b + beta * c`` over the last two axes (float32 accumulation).

    Args:
      a: ``(..., n, k)``.
      b: ``(..., k, n)``.
      c: optional ``(..., n, n)`` addend; ignored when ``None``.
      alpha: scale of the product.
      beta: scale of ``c``.
      out_dtype: output dtype; defaults to ``a.dtype``.

    Returns:
      The ``(..., n, n)`` result.
    """
    out_dtype = a.dtype if out_dtype is None else out_dtype
    acc_dtype = _acc_dtype(a.dtype)
    acc = jnp.einsum("...ik,...kj->...ij", a, b, preferred_element_type=acc_dtype)
    acc = alpha * acc
    if c is not None:
        acc = acc + beta * c.astype(acc_dtype)
    return acc.astype(out_dtype)
