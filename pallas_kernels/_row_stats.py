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
"""The statistics pass: ``S = d ⊙ M + G`` written in place of ``M``, with each row's ℓ1 norm and
sum of squares, from one read of ``M`` and ``G``.

Dion3's step needs three things of the summed momentum ``S`` before it can select rows: the rows'
ℓ1 norms (the selection scores), their sums of squares (the norm of the selected rows' payload),
and ``S`` itself, which the payload pass reads next. ``d`` is a per-row factor: the error
feedback's decay ``μ`` of the rows selected at the step before, which that step left to this
pass (so that it did not have to write the momentum a second time). Writing ``S`` here, and not
``μ·S[I]`` and ``S`` after the selection, makes the payload pass a read of ``S`` alone: the step
moves four full arrays through memory (``M``, ``G`` and ``S`` here, ``S`` in the payload pass)
instead of five.

- ``"mosaic"``: a Pallas Mosaic GPU kernel (Hopper), :mod:`pallas_kernels._row_stats_mosaic`;
  what ``"auto"`` runs on Hopper.
- ``"pallas_triton"``: a Pallas kernel through Pallas' Triton lowering (NVIDIA GPUs),
  :mod:`pallas_kernels._row_stats_triton`; jax 0.11 deprecates that lowering (compiling it
  prints a ``DeprecationWarning``), so it runs only when named.
- ``"xla"``: :func:`accumulate_rows_reference` (:mod:`pallas_kernels._row_stats_reference`),
  plain jnp.

The squares are of ``S·2⁻³²`` (overflow-safe, as ``dion3_jax``'s norms take them); ``S``
saturates at ``±2⁷⁹`` (:func:`pallas_kernels.scaled_sum`), so neither sum overflows.

Reference: Amsel et al., *Dion3: Full-Stack Orthogonal Updates*, 2026 (selection and error
feedback).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from pallas_kernels import _dispatch, _row_stats_mosaic, _row_stats_triton
from pallas_kernels._counter import RowCounter, check_counter
from pallas_kernels._row_stats_reference import accumulate_rows_reference
from pallas_kernels._stochastic_rounding import STOCHASTIC_DTYPES

RowStatsImplementation = Literal["auto", "xla", "mosaic", "pallas_triton"]
#: The kernels ``"auto"`` takes, in order of preference: the Mosaic kernel (faster than the
#: Pallas-Triton kernel on every 7B-shapes group, docs/KERNELS.md). The Pallas-Triton kernel
#: runs only when named: its lowering is deprecated.
AUTO = ("mosaic",)


def _check(m, g, scale, row_axis) -> None:
    if row_axis not in (1, 2):
        raise ValueError(f"row_axis must be 1 or 2, got {row_axis!r}")
    if m.ndim != 3 or g.shape != m.shape:
        raise ValueError(f"momentum {m.shape} and gradient {g.shape} must be one (batch, a, b) "
                         f"shape")
    if jnp.shape(scale) != (m.shape[0], m.shape[row_axis]):
        raise ValueError(f"scale must be (batch, rows) = {(m.shape[0], m.shape[row_axis])} for "
                         f"row_axis={row_axis}, got {jnp.shape(scale)}")
    for name, x in (("momentum", m), ("gradient", g), ("scale", scale)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be floating, got {x.dtype}")


def accumulate_rows_implementation(shape: tuple[int, int], row_axis: int,
                                   implementation: RowStatsImplementation = "auto",
                                   interpret: bool = False) -> str:
    """What :func:`accumulate_rows` runs for matrices of ``shape`` on the target device.

    A caller that gets ``"xla"`` may compute the pass in its own array shape instead
    (:func:`pallas_kernels.scaled_sum` is elementwise): XLA writes a result in place of a donated
    operand only when both have one shape, so a momentum viewed as ``(batch, a, b)`` would
    otherwise be summed into a new buffer and copied back.

    Args:
      shape: ``(a, b)``, each matrix's shape (the call's ``m.shape[1:]``).
      row_axis: the axis of the rows, 1 or 2, as in :func:`accumulate_rows`.
      implementation: what the caller asks for, as in :func:`accumulate_rows`.
      interpret: whether the kernel would run through an interpreter (CPU tests). A 16-bit
        momentum rounded stochastically changes no choice: both kernels hash a counter's bits
        themselves (a bits array is for XLA only, :func:`accumulate_rows`).

    Returns:
      ``"xla"``, ``"mosaic"`` or ``"pallas_triton"``.

    Raises:
      ValueError: for an unknown implementation or a kernel that cannot run this call.

    Examples:
      >>> from pallas_kernels import accumulate_rows_implementation
      >>> accumulate_rows_implementation((64, 256), 1, "xla")
      'xla'
    """
    fits = {"mosaic": _row_stats_mosaic.blocks(shape, row_axis) is not None,
            "pallas_triton": _row_stats_triton.blocks(shape, row_axis) is not None}
    needs = {"mosaic": f"an extent along axis 1 that is a multiple of 64 and a minor axis with "
                       f"a power-of-two divisor of at least 16, got {shape} "
                       f"(row_axis={row_axis})",
             "pallas_triton": f"a minor axis with a power-of-two divisor of at least "
                              f"{_row_stats_triton.MIN_MINOR}, got {shape} "
                              f"(row_axis={row_axis})"}
    return _dispatch.resolve_pass("accumulate_rows", implementation, fits, needs, interpret,
                                  auto=AUTO)


def accumulate_rows(m: jax.Array, g: jax.Array, scale: jax.Array, *, row_axis: int,
                    implementation: RowStatsImplementation = "auto", interpret: bool = False,
                    partial_sums: bool = False, bits: jax.Array | None = None,
                    counter: RowCounter | None = None, out_scale: jax.Array | None = None
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``S = d ⊙ M + G`` per row, and each row's ℓ1 norm and scaled sum of squares.

    Args:
      m: momenta ``(batch, a, b)``; the kernels write ``S`` into its buffer when it is donated.
      g: gradients shaped like ``m`` (any floating dtype).
      scale: ``(batch, n)`` per-row factors ``d`` (``n = m.shape[row_axis]``).
      row_axis: the axis of the rows (1 or 2).
      implementation: ``"mosaic"`` (the Mosaic GPU kernel, :mod:`pallas_kernels._row_stats_mosaic`;
        Hopper, or ``interpret``; ``a`` a multiple of 64 and a minor axis with a power-of-two
        divisor of at least 16), ``"pallas_triton"`` (the kernel through Pallas' deprecated
        Triton lowering; NVIDIA GPUs, or ``interpret``), ``"xla"``, or ``"auto"``: the first of
        :data:`AUTO` that runs here and takes the shape, else XLA.
      interpret: run the kernel through an interpreter (CPU tests).
      partial_sums: return each row sum as ``(batch, c, n)`` partial sums over ``c`` chunks of
        the summed axis (``c = 1`` for XLA), to be added over axis 1 by the caller. A caller
        with many calls concatenates their partials and adds them in one reduction, which XLA
        fuses into the sums' readers, instead of one small reduction per call.
      bits: uint32 random bits shaped like ``m``: a bfloat16 or float16 ``S`` is rounded
        stochastically with them (:func:`pallas_kernels.scaled_sum`); XLA only (a kernel
        would read 4 bytes of bits per element).
      counter: the random bits as a :class:`pallas_kernels._counter.RowCounter` (a key and
        each row's counter words): a bfloat16 or float16 ``S`` is rounded stochastically with
        :func:`pallas_kernels._counter.counter_bits`, which the kernels hash themselves, bit
        for bit XLA's. Not with ``bits``.
      out_scale: a float32 scalar, a power of two: ``S = out_scale·(d ⊙ M + G)`` (``d`` and
        ``G`` multiplied first, exactly), for a momentum kept in units of ``1/out_scale`` of
        the gradients' (the range of a float16 momentum, :func:`pallas_kernels.scaled_sum`).

    Returns:
      ``(S, l1, sq)``: ``S`` in ``m``'s dtype (computed in float32), and float32 ``(batch, n)``
      arrays of ``Σ_j |S_ij|`` and ``Σ_j (S_ij·2⁻³²)²`` per row ``i`` (``(batch, c, n)``
      partial sums with ``partial_sums``).

    Raises:
      ValueError: for mismatched shapes, an unknown implementation, or a kernel that cannot
        run this call.

    Examples:
      >>> import jax.numpy as jnp
      >>> from pallas_kernels import accumulate_rows
      >>> m, g = jnp.ones((1, 2, 16)), jnp.ones((1, 2, 16))
      >>> s, l1, sq = accumulate_rows(m, g, jnp.full((1, 2), 0.5), row_axis=1,
      ...                             implementation="xla")
      >>> float(s[0, 0, 0]), float(l1[0, 0])
      (1.5, 24.0)
    """
    _check(m, g, scale, row_axis)
    if out_scale is not None and jnp.shape(out_scale) not in ((), (1,)):
        raise ValueError(f"out_scale must be a scalar, got shape {jnp.shape(out_scale)}")
    if bits is not None and counter is not None:
        raise ValueError("accumulate_rows takes the random bits as bits= or counter=, not both")
    sixteen = jnp.dtype(m.dtype) in STOCHASTIC_DTYPES
    if counter is not None:
        check_counter(counter, m.shape[0], m.shape[row_axis])
    if bits is not None and sixteen and implementation not in ("auto", "xla"):
        raise ValueError(f"accumulate_rows: implementation={implementation!r} takes the random "
                         f"bits as counter= (hashed in the kernel), not as a bits array; use "
                         f"counter= or 'xla'")
    chosen = accumulate_rows_implementation(
        (m.shape[1], m.shape[2]), row_axis, "xla" if bits is not None and sixteen
        else implementation, interpret)
    if chosen == "xla":
        s, l1, sq = accumulate_rows_reference(m, g, scale, row_axis=row_axis, bits=bits,
                                              counter=counter, out_scale=out_scale)
        return (s, l1[:, None], sq[:, None]) if partial_sums else (s, l1, sq)
    if chosen == "mosaic":
        s, l1, sq = _row_stats_mosaic.accumulate_rows_mosaic(
            m, g, scale, row_axis=row_axis, interpret=interpret, counter=counter,
            out_scale=out_scale)
    else:
        s, l1, sq = _row_stats_triton.accumulate_rows_triton(
            m, g, scale, row_axis=row_axis, interpret=interpret, counter=counter,
            out_scale=out_scale)
    return (s, l1, sq) if partial_sums else (s, jnp.sum(l1, axis=1), jnp.sum(sq, axis=1))
