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
"""The per-matrix maths of the Dion3 update, as pure functions of arrays.

Blocks are 3-D ``(batch, rows, cols)`` (``row_axis=1``) or ``(batch, cols, rows)``
(``row_axis=2``); every function works per batch element. The step (``_step``) composes them,
adding the all-reduces that a sharded matrix needs between the NorMuon pieces; on one matrix
:func:`normuon` is the whole rule.

References:
  Amsel et al., `Dion3: Full-Stack Orthogonal Updates <https://arxiv.org/abs/2608.11612>`_, 2026
  (error feedback on the selected rows).
  Li et al., `NorMuon: Making Muon more efficient and scalable
  <https://arxiv.org/abs/2510.05491>`_, 2025 (per-row second moments).
  Liu et al., `Muon is Scalable for LLM Training <https://arxiv.org/abs/2502.16982>`_, 2025
  (the ``"rms_norm"`` learning-rate scale).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from dion3_jax import _norms, _selection
from pallas_kernels._stochastic_rounding import STOCHASTIC_DTYPES, stochastic_round

NORMUON_EPS = 1e-8


def update_dtype(grad_dtype) -> jnp.dtype:
    """The dtype of the updates of a leaf whose gradient has ``grad_dtype``: at least float32.

    A 16-bit parameter's update stays in float32 so that the learning rate, the weight decay and
    ``optax.apply_updates`` (which adds it to the parameter in float32) round the new parameter
    once, from float32; float32 and float64 gradients keep their dtype.
    """
    return jnp.promote_types(grad_dtype, jnp.float32)


def lr_scale(adjust_lr: str | None, fan_out: int, fan_in: int) -> float:
    """Shape factor η'/lr of one (fan_out × fan_in) matrix.

    ``"spectral_norm"``: √(fan_out/fan_in); ``"rms_norm"``: 0.2·√max(fan_out, fan_in) (Moonshot's
    AdamW-compatible scale); ``None``: 1. Always from the whole matrix, never the selected rows.
    """
    if adjust_lr == "spectral_norm":
        return math.sqrt(fan_out / fan_in)
    if adjust_lr == "rms_norm":
        return 0.2 * math.sqrt(max(fan_out, fan_in))
    return 1.0


def error_feedback(m: jax.Array, selected: jax.Array | None, mu, sources: tuple | None,
                   row_axis: int, bits: jax.Array | None = None) -> jax.Array:
    """``M[I] ← μ·S``: only the selected rows decay; the others keep accumulating.

    Args:
      m: the momentum block after ``M ← M + G``.
      selected: ``S``, the selected rows (``(batch, k, C)`` in ``m``'s orientation), averaged
        over the replicas under compressed sync; None when ``S`` is ``m``'s own rows ``M[I]``
        (no replica averaging): then the rows decay in place, ``where(row ∈ I, μ·M, M)``, with
        no gather of ``S``.
      mu: the decay (float32 scalar).
      sources: :func:`dion3_jax._selection.row_sources` of the selected rows, or None when
        every row is selected (then ``S`` is the whole block).
      row_axis: ``m``'s row axis.
      bits: uint32 random bits shaped like ``m``: a bfloat16 or float16 block is computed in
        float32 and rounded stochastically with them (the rows that keep ``M`` keep it
        exactly: a 16-bit value rounds to itself); None: rounded to nearest.

    Returns:
      The new momentum block, in ``m``'s dtype.
    """
    if bits is not None and jnp.dtype(m.dtype) in STOCHASTIC_DTYPES:
        exact = error_feedback(m.astype(jnp.float32), None if selected is None
                               else selected.astype(jnp.float32), mu, sources, row_axis)
        return stochastic_round(exact, m.dtype, bits)
    decayed = (mu * (m if selected is None else selected)).astype(m.dtype)
    if sources is None:
        return decayed
    if selected is None:
        keep = jax.lax.broadcast_in_dim(sources[1], m.shape, (0, row_axis))
        return jax.lax.select(keep, decayed, m)
    return _selection.place_rows(decayed, sources, row_axis, base=m)


def deferred_decay(mu, keep: jax.Array | None, shape: tuple[int, ...]) -> jax.Array:
    """The per-row momentum factors ``d`` (the momentum is ``d ⊙ M``) that defer ``M[I] ← μ·S``
    to the next step's ``S = d ⊙ M + G``: ``μ`` on the selected rows (``keep``, booleans of
    ``shape``; None: every row), 1 elsewhere; float32."""
    full = jnp.broadcast_to(jnp.asarray(mu, jnp.float32), shape)
    return full if keep is None else jax.lax.select(keep, full, jnp.ones(shape, jnp.float32))


def row_sq_norms(o: jax.Array, row_axis: int) -> jax.Array:
    """``Σ_j O_ij²`` per row, ``(batch, rows)``, in float32."""
    return _norms.total(jax.lax.square(o.astype(jnp.float32)), 3 - row_axis)


def normuon_ema(v_sel: jax.Array, row_sq: jax.Array, cols: int, beta2
                ) -> tuple[jax.Array, jax.Array]:
    """NorMuon's second-moment EMA of the selected rows, elementwise.

    Args:
      v_sel: the selected rows' second moments, ``(batch, k)`` float32.
      row_sq: :func:`row_sq_norms` of ``O`` (summed over column shards when sharded).
      cols: the whole matrix's number of columns (``ν_i = row_sq_i / cols``).
      beta2: the EMA coefficient.

    Returns:
      ``(v_new, a)``: ``v ← β₂·v + (1−β₂)·ν`` (no bias correction) and the row divisors
      ``a = √v_new + ε``.
    """
    v_new = beta2 * v_sel + (1.0 - beta2) * (row_sq / cols)
    return v_new, jnp.sqrt(v_new) + NORMUON_EPS


def normuon_scaled_sq(row_sq: jax.Array, a: jax.Array) -> jax.Array:
    """``‖(O/a)_i‖² = row_sq_i / a_i²`` per row, from :func:`row_sq_norms` and the row divisors
    of :func:`normuon_ema`."""
    return row_sq / jnp.square(a)


def normuon_fro(row_sq: jax.Array, a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(‖O‖_F², ‖O/a‖_F²)`` per batch element, each ``(batch,)``, from :func:`row_sq_norms` and
    the row divisors of :func:`normuon_ema` (summed over row shards when sharded)."""
    return jnp.sum(row_sq, axis=1), jnp.sum(normuon_scaled_sq(row_sq, a), axis=1)


def normuon_moments(v_sel: jax.Array, row_sq: jax.Array, cols: int, beta2
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`normuon_ema` and :func:`normuon_fro` together: ``(v_new, a, fro)``.

    Args:
      v_sel: the selected rows' second moments, ``(batch, k)`` float32.
      row_sq: :func:`row_sq_norms` of ``O`` (summed over column shards when sharded).
      cols: the whole matrix's number of columns.
      beta2: the EMA coefficient.

    Returns:
      The new second moments, the row divisors and the Frobenius terms ``(2, batch)``.
    """
    v_new, a = normuon_ema(v_sel, row_sq, cols, beta2)
    return v_new, a, jnp.stack(normuon_fro(row_sq, a))


def normuon_row_scales(a: jax.Array, fro: jax.Array) -> jax.Array:
    """The factor of each row in :func:`normuon_directions`, ``(batch, k)``: ``(1/a) · ‖O‖_F /
    max(‖O/a‖_F, ε)``."""
    factor = jnp.sqrt(fro[0]) / jnp.maximum(jnp.sqrt(fro[1]), NORMUON_EPS)
    return (1.0 / a) * factor[:, None]


def scale_rows(o: jax.Array, scales: jax.Array, row_axis: int) -> jax.Array:
    """``O`` times its :func:`normuon_row_scales`, in float32."""
    return o.astype(jnp.float32) * jnp.expand_dims(scales, 3 - row_axis)


def normuon_directions(o: jax.Array, a: jax.Array, fro: jax.Array, row_axis: int) -> jax.Array:
    """``D = O / a``, rescaled to ``‖O‖_F``: ``D · ‖O‖_F / max(‖O/a‖_F, ε)``, float32."""
    return scale_rows(o, normuon_row_scales(a, fro), row_axis)


def normuon(o: jax.Array, v_sel: jax.Array, beta2, row_axis: int = 1
            ) -> tuple[jax.Array, jax.Array]:
    """NorMuon on whole (unsharded) matrices: ``(D, v_new)`` from the polar factors ``O``.

    Args:
      o: the polar factors of the selected rows, ``(batch, k, C)`` (``row_axis=1``).
      v_sel: their second moments, ``(batch, k)`` float32.
      beta2: the EMA coefficient.
      row_axis: ``o``'s row axis.

    Returns:
      The float32 directions and the new second moments.
    """
    row_sq = row_sq_norms(o, row_axis)
    v_new, a, fro = normuon_moments(v_sel, row_sq, o.shape[3 - row_axis], beta2)
    return normuon_directions(o, a, fro, row_axis), v_new


def muon_directions(o: jax.Array) -> jax.Array:
    """Muon: the polar factors themselves, float32."""
    return o.astype(jnp.float32)
