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
"""The payload pass: the selected rows of the summed momenta, normalized, in float16, stacked.

Once the rows ``I`` are selected and the payload's norm is known, the step needs the polar
operator's input ``S[I] / (‖S[I]‖_F + ε)`` in the compute dtype, stacked with the other matrices of
its shape. ``S = d ⊙ M + G`` was written by the statistics pass
(:func:`pallas_kernels.accumulate_rows`), so this pass reads ``S`` and writes the payload, for
every row selected (Dion3 at ``f = 1``, or a matrix with ``k = n``) or for given rows (``rows``).
The error feedback's decay of the selected rows is not written here: the step leaves it to the
next statistics pass as the per-row factor ``d``.

- ``"pallas_triton"``: a Pallas kernel through Pallas' Triton lowering (NVIDIA GPUs),
  :mod:`pallas_kernels._payload_triton`; jax 0.11 deprecates that lowering (compiling prints a
  ``DeprecationWarning``), so it runs only when named.
- ``"mosaic"``: without ``rows``, a Pallas Mosaic GPU kernel (Hopper),
  :mod:`pallas_kernels._payload_mosaic`; what ``"auto"`` runs for every row on Hopper.
- ``"xla"``: :func:`stack_payloads_reference`, plain jnp (with ``rows``, a gather); what
  ``"auto"`` runs for selected rows (XLA fuses the gather, the division and the cast into one
  pass).

Reference: Amsel et al., *Dion3: Full-Stack Orthogonal Updates*, 2026 (selection and error
feedback).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp

from pallas_kernels import _dispatch, _payload_mosaic, _payload_triton
from pallas_kernels._payload_reference import stack_payloads_reference

PayloadImplementation = Literal["auto", "xla", "mosaic", "pallas_triton"]

#: The kernels ``"auto"`` takes, in order of preference: the Mosaic kernel (every row; the step
#: is as fast with it as with the Pallas-Triton kernel, docs/KERNELS.md); selected rows go to
#: XLA, whose gather is as fast there. The Pallas-Triton kernel runs only when named: its
#: lowering is deprecated.
AUTO = ("mosaic",)


def _check(sums, denoms, rows, row_axis) -> None:
    if not sums:
        raise ValueError("stack_payloads needs at least one member")
    if row_axis not in (1, 2):
        raise ValueError(f"row_axis must be 1 or 2, got {row_axis!r}")
    shape = sums[0].shape[1:]
    for i, m in enumerate(sums):
        if m.ndim != 3 or m.shape[1:] != shape:
            raise ValueError(f"member {i}: sums {m.shape} must be (batch, *{shape})")
    total = sum(m.shape[0] for m in sums)
    if getattr(denoms, "shape", None) != (total,):
        raise ValueError(f"denoms must be an array of one divisor per matrix of the stack, "
                         f"({total},), got {getattr(denoms, 'shape', type(denoms))}")
    if rows is not None and (getattr(rows, "ndim", None) != 2 or rows.shape[0] != total
                             or not jnp.issubdtype(rows.dtype, jnp.integer)):
        raise ValueError(f"rows must be an integer array ({total}, pick), one row of indices "
                         f"per matrix of the stack, got "
                         f"{getattr(rows, 'dtype', type(rows))} {getattr(rows, 'shape', '')}")


def implementation_for(shape: tuple[int, int], implementation: str, interpret: bool = False,
                       every_row: bool = False) -> str:
    """What :func:`stack_payloads` runs for members of matrix ``shape`` on the target device:
    ``"xla"``, ``"mosaic"`` or ``"pallas_triton"``; ``every_row``: a call without ``rows``.

    Raises:
      ValueError: for an unknown implementation or a kernel that cannot run this call.
    """
    fits = {"mosaic": every_row and _payload_mosaic.blocks(shape) is not None,
            "pallas_triton": _payload_triton.block_shape(*shape) is not None}
    needs = {"mosaic": f"every row (no rows=) and matrices whose columns have a power-of-two "
                       f"divisor of at least 16, blocks of at least 1024 elements, got {shape}"
                       f"{'' if every_row else ' with rows'}",
             "pallas_triton": f"matrices whose columns are a multiple of "
                              f"{_payload_triton.MIN_BLOCK_COLS}, got {shape}"}
    return _dispatch.resolve_pass("stack_payloads", implementation, fits, needs, interpret,
                                  auto=AUTO)


def stack_payloads(sums: Sequence[jax.Array], denoms: jax.Array, *, out_dtype,
                   rows: jax.Array | None = None, row_axis: int = 1,
                   padded: bool = True, pad_to: int | None = None,
                   implementation: PayloadImplementation = "auto", interpret: bool = False
                   ) -> jax.Array:
    """Normalized payloads of selected rows, stacked.

    Returns the concatenation along axis 0 of the payloads ``P_i / denoms_i`` (per matrix, in
    float32, cast to ``out_dtype``). Without ``rows`` every row is selected and ``P_i = S_i``;
    with them, ``P_i`` holds the rows ``rows_i`` of ``S_i`` in their order (along ``row_axis``),
    and zeros where an index is ``≥ n`` (padding), then zero rows up to ``pad_to``. The small
    per-matrix arrays ``denoms`` and ``rows`` come stacked like the result, so that a caller
    holding them stacked does not slice them per member.

    Args:
      sums: the members' summed momenta ``S_i``, each ``(batch_i, a, b)``; one matrix shape for
        all.
      denoms: ``(Σ batch_i,)`` divisors (``‖P‖_F + ε``), one per matrix of the stack.
      out_dtype: the stack's dtype.
      rows: ``(Σ batch_i, pick)``, per matrix of the stack its distinct integer rows in
        ``[0, n)`` or ``≥ n`` (padding); None: every row.
      row_axis: the axis of the rows (1 or 2; ``n`` is its length).
      padded: whether ``rows`` may hold padding. With False (every index in range) the
        kernel's stack is not zeroed first: every payload row is written by the kernel.
      pad_to: with ``rows``, the payload's row count (``≥ pick``): zero rows follow the
        selected ones, so a consumer that pads its input to tile multiples finds it padded
        (the kernel writes the zero rows after its launches, or zeroes the whole stack first
        under ``padded``). None: ``pick``.
      implementation: ``"pallas_triton"`` (the kernel; NVIDIA GPUs, or ``interpret``; its
        columns ``b`` a multiple of 32), ``"mosaic"`` (the Mosaic GPU kernel,
        :mod:`pallas_kernels._payload_mosaic`; Hopper, or ``interpret``; without ``rows``
        only), ``"xla"``, or ``"auto"``: the first of :data:`AUTO` that runs here and takes
        the call (the Mosaic kernel for every row on Hopper), else XLA.
      interpret: run the kernel through Pallas' interpreter (CPU tests).

    Returns:
      ``(Σ batch_i, *payload)`` in ``out_dtype``: the payload is ``(a, b)``, or ``pad_to``
      (``pick``) rows along ``row_axis``.

    Raises:
      ValueError: for mismatched members, an unknown implementation, or ``"pallas_triton"`` where it
        cannot run.

    Examples:
      >>> import jax.numpy as jnp
      >>> from pallas_kernels import stack_payloads
      >>> s = jnp.ones((1, 4, 32))
      >>> stack = stack_payloads([s, 3 * s], jnp.full(2, 2.0), out_dtype=jnp.float16,
      ...                        implementation="xla")
      >>> stack.shape, float(stack[0, 0, 0]), float(stack[1, 0, 0])
      ((2, 4, 32), 0.5, 1.5)
    """
    sums = list(sums)
    _check(sums, denoms, rows, row_axis)
    pick = _check_pad_to(rows, pad_to)
    _, a, b = sums[0].shape
    if rows is not None and pad_to is not None and pad_to > rows.shape[1]:
        rows = _padded_rows(rows, sums[0].shape[row_axis], pad_to)
    chosen = implementation_for((a, b), implementation, interpret, every_row=rows is None)
    if chosen == "xla":
        return stack_payloads_reference(sums, denoms, out_dtype=out_dtype, rows=rows,
                                        row_axis=row_axis)
    if chosen == "mosaic":
        if len({x.dtype for x in sums}) != 1:
            raise ValueError(f"stack_payloads: implementation='mosaic' needs one dtype for all "
                             f"sums, got {[str(x.dtype) for x in sums]}")
        return _payload_mosaic.stack_payloads_mosaic(sums, denoms, out_dtype=jnp.dtype(out_dtype),
                                                     interpret=interpret)
    return _payload_triton.stack_payloads_triton(sums, denoms, out_dtype=out_dtype, rows=rows,
                                                 row_axis=row_axis, padded=padded,
                                                 zero_from=pick, interpret=interpret)


def _padded_rows(rows: jax.Array, n: int, pad_to: int) -> jax.Array:
    """``rows`` followed by distinct padding indices ``n, n + 1, …`` up to ``pad_to`` each."""
    pad = jnp.broadcast_to(jnp.arange(n, n + pad_to - rows.shape[1], dtype=rows.dtype),
                           (rows.shape[0], pad_to - rows.shape[1]))
    return jnp.concatenate([rows, pad], axis=1)


def _check_pad_to(rows, pad_to) -> int | None:
    """The selected rows' count (None without ``rows``); ``pad_to`` must not be below it."""
    pick = None if rows is None else rows.shape[1]
    if pad_to is not None and (pick is None or pad_to < pick):
        raise ValueError(f"pad_to needs rows and must be at least their count {pick}, got "
                         f"{pad_to=}")
    return pick
