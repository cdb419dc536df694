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
"""The Newton-Schulz iterations written out step by step with the coefficients as Python
floats (literals in the traced program): the formulation the library had before its steps took
their coefficients as array operands. ``tests/test_polar.py`` checks that the library's
iterations give these bits."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels


def _matmul(a, b):
    if jnp.dtype(a.dtype).itemsize == 2:
        return jnp.einsum("...ik,...kj->...ij", a, b, preferred_element_type=a.dtype)
    acc = jnp.promote_types(a.dtype, jnp.float32)
    return jnp.einsum("...ik,...kj->...ij", a, b, preferred_element_type=acc).astype(a.dtype)


def _plus_diagonal(z, a: float):
    i = jnp.arange(z.shape[-1])
    return z.at[..., i, i].add(jnp.asarray(a, z.dtype))


def _tall(x) -> bool:
    return x.shape[-2] > x.shape[-1]


def _gram(x):
    return pallas_kernels.syrk(x, transpose=_tall(x), implementation="xla")


def _apply(q, x):
    return _matmul(x, q) if _tall(x) else _matmul(q, x)


def _sym(a, b, c, alpha: float, beta: float):
    return pallas_kernels.sym_matmul_reference(a, b, c, alpha=alpha, beta=beta)


def standard(x, coeffs):
    """Standard Newton-Schulz, one Python-unrolled step per ``(a, b, c)``."""
    for a, b, c in coeffs:
        gram = _gram(x)
        x = _apply(_plus_diagonal(_sym(gram, gram, gram, c, b), a), x)
    return x


def gram(x, coeffs, restarts):
    """Gram Newton-Schulz with restarts, one Python-unrolled step per ``(a, b, c)``."""
    restart_set, last = set(restarts), len(coeffs) - 1
    r, q = _gram(x), None
    for i, (a, b, c) in enumerate(coeffs):
        if i in restart_set and i != 0:
            x = _apply(q, x)
            r, q = _gram(x), None
        w = _plus_diagonal(_sym(r, r, r, c, b), a)
        q = w if q is None else _sym(q, w, None, 1.0, 0.0)
        if i != last and (i + 1) not in restart_set:
            r = _sym(w, _sym(r, w, None, 1.0, 0.0), None, 1.0, 0.0)
    return _apply(q, x)
