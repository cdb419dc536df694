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
"""The symmetric products ``syrk`` and ``sym_matmul``, and their implementations.

``implementation`` names one (:mod:`pallas_kernels._dispatch` resolves it):

- ``"xla"``: the plain jnp reference (:mod:`pallas_kernels._reference`); always available.
- ``"mosaic"``: the Pallas Mosaic GPU kernel (:mod:`pallas_kernels._mosaic`); Hopper (sm_90) only,
  float16/bfloat16 operands; with ``interpret=True`` it runs anywhere through GPU interpret mode.
- ``"jax_triton"``: the Triton kernel called through jax-triton (:mod:`pallas_kernels._triton`);
  NVIDIA GPUs with ``jax_triton`` installed, float16/bfloat16 operands; no interpret mode.
- ``"auto"``: the fastest kernel measured on this kind of device for 16-bit operands when one
  call's ``batch · n² · k`` (the full product's multiply-adds) is at least ``AUTO_MIN_WORK``,
  else ``"xla"``.

A named implementation that cannot run raises ``ValueError``; there is no silent fallback.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _dispatch
from pallas_kernels._common import KERNEL_DTYPES
from pallas_kernels._dispatch import Implementation, available_implementations
from pallas_kernels._reference import sym_matmul_reference, syrk_reference

#: "auto" uses a kernel only for ``batch · n² · k >= AUTO_MIN_WORK`` (``k``: the contraction
#: length): below that the lower-triangle walk has too few tiles, or too short a main loop, to
#: beat XLA, and a kernel's compile time and launch outweigh microseconds. The line sits at
#: 4·1024³ = 2³², a batch of 32 products 512×512×512 (the f = 1/8 step's attention Gram
#: iterations); docs/KERNELS.md has the measurements.
AUTO_MIN_WORK = 4 * 1024 ** 3

#: The symmetric products' kernels, and "auto"'s preference per GPU generation (first available
#: wins; benchmarks/bench_kernels.py).
_KERNELS = ("mosaic", "jax_triton")
_AUTO_PREFERENCE = {
    "hopper": ("mosaic", "jax_triton"),
    "other": ("jax_triton",),
}


def _work(shape) -> int:
    """``batch · n² · k`` for a left operand of shape ``(..., n, k)``."""
    batch = 1
    for d in shape[:-2]:
        batch *= d
    return batch * shape[-2] * shape[-2] * shape[-1]


def _resolve(implementation: str, *, dtypes, size: int, interpret) -> str:
    """Returns the concrete backend for one call (``size``: :func:`_work`), or raises."""
    fits = all(jnp.dtype(d) in KERNEL_DTYPES for d in dtypes)
    generation = "hopper" if _dispatch.is_hopper(_dispatch.target_device()) else "other"
    auto = _AUTO_PREFERENCE[generation] if size >= AUTO_MIN_WORK else ()
    return _dispatch.resolve(
        "syrk/sym_matmul", implementation, supported=_KERNELS, auto=auto, fits=fits,
        needs=f"float16/bfloat16 operands, got dtypes {[str(jnp.dtype(d)) for d in dtypes]}",
        interpret=interpret, interpretable=("mosaic",))


#: Row and contraction multiples the kernels pad their operands to (the default tile and panel
#: depth of ``MosaicConfig`` and ``TritonConfig``): operands already aligned skip the padding copy.
TILE_MULTIPLES = (128, 64)


def padding_multiples(shape, dtype, implementation: Implementation = "auto"
                      ) -> tuple[int, int] | None:
    """The ``(rows, contraction)`` multiples a kernel would pad ``syrk`` of ``shape`` to.

    A caller that runs many products on one operand (Gram Newton-Schulz) can zero-pad it once to
    these multiples instead of every product padding its operands and slicing its result.

    Args:
      shape: ``(..., n, m)`` shape of the ``syrk`` operand.
      dtype: its dtype.
      implementation: as for :func:`syrk`.

    Returns:
      ``TILE_MULTIPLES`` when ``implementation`` resolves to a kernel for this operand, ``None``
      when it resolves to ``"xla"`` (which needs no padding).

    Raises:
      ValueError: as :func:`syrk` would for this implementation.
    """
    impl = _resolve(implementation, dtypes=(dtype,), size=_work(shape), interpret=False)
    return None if impl == "xla" else TILE_MULTIPLES


def syrk(x: jax.Array, *, transpose: bool = False, out_dtype=None,
         implementation: Implementation = "auto", interpret: bool = False) -> jax.Array:
    """Returns ``x · xᵀ`` (or ``xᵀ · x``) over the last two axes, batched over leading axes.

    Only the lower-triangular tiles are computed by the kernels; the upper ones are their mirror, so
    their result is exactly symmetric. ``"xla"`` computes every element, and its two halves may
    differ by a rounding (XLA's dot does not promise one summation order for both).

    Args:
      x: ``(..., n, m)``.
      transpose: return ``xᵀ · x``, ``(..., m, m)`` (BLAS ``syrk`` with ``trans='T'``): the Gram
        matrix of a tall ``x``'s columns, computed without a transposed copy of ``x``.
      out_dtype: output dtype (default ``x.dtype``); accumulation is float32.
      implementation: ``"auto"``, ``"xla"``, ``"mosaic"`` or ``"jax_triton"`` (module docstring).
      interpret: run the Mosaic kernel through GPU interpret mode (CPU tests).

    Returns:
      The ``(..., n, n)`` Gram matrix (``(..., m, m)`` with ``transpose``).

    Raises:
      ValueError: for an unknown implementation, or a named one that cannot run here.
    """
    shape = (*x.shape[:-2], x.shape[-1], x.shape[-2]) if transpose else x.shape
    impl = _resolve(implementation, dtypes=(x.dtype,), size=_work(shape), interpret=interpret)
    if impl == "mosaic":
        from pallas_kernels._mosaic import syrk_mosaic

        return syrk_mosaic(x, transpose=transpose, out_dtype=out_dtype, interpret=interpret)
    if impl == "jax_triton":
        from pallas_kernels._triton import syrk_triton

        return syrk_triton(x, transpose=transpose, out_dtype=out_dtype)
    return syrk_reference(x, transpose=transpose, out_dtype=out_dtype)


def _scale_operand(value):
    """A scale as the kernels' jitted wrappers take it: a float32 scalar that is not weakly
    typed, whether it came as a Python float or an array, so calls with either kind trace (and
    lower) one kernel, not one per kind."""
    if isinstance(value, (int, float)):
        return np.float32(value)
    return jnp.asarray(value, jnp.float32)


def sym_matmul(a: jax.Array, b: jax.Array, c: jax.Array | None = None, *, alpha=1.0,
               beta=0.0, out_dtype=None, implementation: Implementation = "auto",
               interpret: bool = False) -> jax.Array:
    """Returns ``alpha · a · b + beta · c`` where the result is known to be symmetric.

    Meant for products of commuting symmetric matrices (polynomials of one Gram matrix, as in Gram
    Newton-Schulz). The kernels compute the lower-triangular tiles only and mirror them exactly.
    Elements inside a diagonal tile are as computed: Triton's are exactly symmetric (the mirror
    is copied), Mosaic's and XLA's are symmetric up to one rounding. ``c`` must be symmetric
    (its lower triangle is read).

    Args:
      a: ``(..., n, k)``.
      b: ``(..., k, n)``.
      c: optional symmetric ``(..., n, n)`` addend.
      alpha: scale of the product: a float or a scalar array (may be traced; in the
        accumulation dtype, float32 for 16-bit operands). The Mosaic and Triton kernels read
        ``alpha`` and ``beta`` at run time, so all products of one shape share one compiled
        kernel.
      beta: scale of ``c`` (likewise).
      out_dtype: output dtype (default ``a.dtype``); accumulation is float32.
      implementation: ``"auto"``, ``"xla"``, ``"mosaic"`` or ``"jax_triton"`` (module docstring).
      interpret: run the Mosaic kernel through GPU interpret mode (CPU tests).

    Returns:
      The ``(..., n, n)`` result.

    Raises:
      ValueError: for an unknown implementation, a named one that cannot run here, or mismatched
        shapes.
    """
    if a.shape[-1] != b.shape[-2] or a.shape[-2] != b.shape[-1]:
        raise ValueError(f"need a (..., n, k) and b (..., k, n), got {a.shape=} {b.shape=}")
    if c is not None and c.shape[-2:] != (a.shape[-2], a.shape[-2]):
        raise ValueError(f"c must be (..., n, n) with n={a.shape[-2]}, got {c.shape=}")
    impl = _resolve(implementation, dtypes=(a.dtype, b.dtype), size=_work(a.shape),
                    interpret=interpret)
    if impl != "xla":  # One operand type for Python floats and arrays: one traced kernel.
        alpha, beta = _scale_operand(alpha), _scale_operand(beta)
    if impl == "mosaic":
        from pallas_kernels._mosaic import sym_matmul_mosaic

        return sym_matmul_mosaic(a, b, c, alpha=alpha, beta=beta, out_dtype=out_dtype,
                                 interpret=interpret)
    if impl == "jax_triton":
        from pallas_kernels._triton import sym_matmul_triton

        return sym_matmul_triton(a, b, c, alpha=alpha, beta=beta, out_dtype=out_dtype)
    return sym_matmul_reference(a, b, c, alpha=alpha, beta=beta, out_dtype=out_dtype)
