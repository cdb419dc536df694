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
"""A float16 momentum's storage scale: each leaf kept in units that fit float16's range.

float16 keeps 11 significant bits over a narrow range: it saturates past 65504, and below
6.1e-5 (its smallest normal number) it keeps fewer bits, none below 6e-8. A momentum whose
entries sit there (a large model's gradients are often of order 1e-6, a summed loss's past
1e5) would lose them silently. So a float16 momentum is stored in units of a power of two per
leaf, chosen at each write from a bound on the leaf's entries:

- The state keeps, per leaf, ``bound``: the largest ℓ2 norm of a row of the momentum the step
  before wrote (an upper bound on its largest entry), in the gradients' units, the same on
  every device (a ``pmax`` over the step's mesh axes).
- The write scale is ``c = 2^(TARGET − ⌈log2 bound⌉)``: the stored rows' norms are at most
  ``2^TARGET`` = 1024, so an entry can grow 64× in one step before it saturates, and entries
  down to ``2⁻²⁴`` of the bound keep all 11 bits. At the first step (``count == 0``) the bound
  is the gradients' largest entry.
- The step writes ``S·c = (c·d) ⊙ M + c·G`` (:func:`pallas_kernels.accumulate_rows`'s
  ``out_scale``) and leaves ``d/c`` in the momentum's row factors, so the state's
  ``momentum * momentum_scale`` is the momentum in the gradients' units, as for any dtype.

Every power of two is exact, and for a value in float16's normal range stochastic rounding
commutes with it (the same bits round ``c·x`` to ``c`` times what they round ``x`` to). So the
scale changes a float16 momentum's rounding only where the unscaled value would have saturated
or lost bits. Everything the step computes from ``S`` is unchanged by a power of two per leaf:
the selection ranks a matrix's rows by their ℓ1 norms, and the payload is ``S[I]/‖S[I]‖``.

bfloat16 (float32's range) and float32 momenta are stored as they are.
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

#: The exponent of the stored rows' largest norm.
TARGET = 10

#: Write scales stay within ``2^±LIMIT``, where their products with float32 factors and
#: gradients stay exact.
LIMIT = 100


def scaled(dtype) -> bool:
    """Whether a momentum of ``dtype`` is stored with a scale (float16)."""
    return jnp.dtype(dtype) == jnp.dtype(jnp.float16)


def _usable(x: jax.Array) -> jax.Array:
    """Whether float32 ``x`` is finite and at least float32's smallest normal number."""
    return jnp.isfinite(x) & (x >= np.finfo(np.float32).tiny)


def _floor_log2(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``⌊log2 x⌋`` of a positive normal float32 from its bits (exact on every backend), and
    whether ``x`` is not a power of two (its mantissa bits are not all zero)."""
    u = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return (u >> np.uint32(23)).astype(jnp.int32) - 127, (u & np.uint32(0x7FFFFF)) != 0


def _pow2(e: jax.Array) -> jax.Array:
    """``2^e`` for int32 ``e`` within ``±LIMIT``, exactly (from its bits)."""
    e = jnp.clip(e, -LIMIT, LIMIT)
    return lax.bitcast_convert_type(((e + 127) << 23).astype(jnp.uint32), jnp.float32)


def write_scale(bound: jax.Array) -> jax.Array:
    """The float32 scale ``2^(TARGET − ⌈log2 bound⌉)`` (within ``2^±LIMIT``) of a write whose
    rows' norms are at most about ``bound``; 1 where ``bound`` is 0, subnormal or not finite.

    Examples:
      >>> import jax.numpy as jnp
      >>> float(write_scale(jnp.float32(3e-6))), float(write_scale(jnp.float32(0.0)))
      (268435456.0, 1.0)
    """
    bound = jnp.asarray(bound, jnp.float32)
    ok = _usable(bound)
    floor, inexact = _floor_log2(jnp.where(ok, bound, 1.0))
    return jnp.where(ok, _pow2(TARGET - floor - inexact.astype(jnp.int32)), np.float32(1))


def fold_unit(d: jax.Array) -> jax.Array:
    """A power of two per leaf for a folded scaled momentum's row factors (``d`` its factors):
    ``2^⌊log2 max d⌋``, so that ``M·(d/unit)`` stays within twice the stored range; 1 where no
    factor is positive."""
    top = jnp.max(d.astype(jnp.float32))
    return _pow2(_floor_log2(jnp.where(_usable(top), top, 1.0))[0])
