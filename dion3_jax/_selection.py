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
"""Top-ℓ1 row selection: the k rule, row norms, and gather / scatter of rows of a block.

Blocks are 3-D ``(batch, n, C)`` (``row_axis=1``) or ``(batch, C, n)`` (``row_axis=2``); every
function here works per batch element.

References:
  Amsel et al., `Dion3: Full-Stack Orthogonal Updates <https://arxiv.org/abs/2608.11612>`_, 2026
  (row selection with error feedback).
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp

from dion3_jax import _norms


def num_selected(fraction: float, n: int) -> int:
    """``k = max(1, ceil(fraction · n))``, computed in float64 (``0.07 · 100 → 8``).

    Args:
      fraction: selected fraction in ``(0, 1]``.
      n: number of rows.

    Returns:
      The number of rows to select, in ``[1, n]``.
    """
    return min(n, max(1, math.ceil(float(fraction) * n)))


def row_l1_norms(m: jax.Array, row_axis: int) -> jax.Array:
    """ℓ1 norm of each row, ``(batch, n)``, accumulated in float32."""
    col_axis = 3 - row_axis
    return _norms.total(jax.lax.abs(m.astype(jnp.float32)), col_axis)


def row_sq_sums(m: jax.Array, row_axis: int) -> jax.Array:
    """Squared ℓ2 norm of each row scaled by 2⁻⁶⁴, ``(batch, n)``, in float32
    (:func:`dion3_jax._norms.sq_sum`: no overflow; computed beside :func:`row_l1_norms`, over
    the same read of ``m``)."""
    return _norms.sq_sum(m.astype(jnp.float32), 3 - row_axis)


def selected_sq_sum(row_sums: jax.Array, rows: jax.Array, valid: jax.Array | None = None
                    ) -> jax.Array:
    """The selected rows' :func:`row_sq_sums` summed per batch element, ``(batch,)``: the
    (scaled) ``‖M[I]‖_F²`` of the rows ``rows`` (``(batch, k)`` indices; ``valid`` masks out
    padding rows). :func:`dion3_jax._norms.norm_from_sq_sum` turns it into the norm."""
    picked = jnp.take_along_axis(row_sums, rows, axis=1)
    if valid is not None:
        picked = jnp.where(valid, picked, 0.0)
    return jnp.sum(picked, axis=1)


def selected_row_sq_sums(m: jax.Array, rows: jax.Array, row_axis: int) -> jax.Array:
    """:func:`row_sq_sums` of the rows ``rows`` (``(batch, k)``, in range) of ``m``,
    ``(batch, k)``, each added in a fixed order
    (:func:`dion3_jax._norms.sq_sum_in_fixed_order`): a row's sum has the same bits whether
    it is read from a device's shard or from the whole matrix, as a mesh under global scope
    needs to match one device."""
    picked = gather_rows(m, rows, row_axis).astype(jnp.float32)
    return _norms.sq_sum_in_fixed_order(picked, 3 - row_axis)


def random_scores(seed: int, count: jax.Array, uid: int, shape: tuple[int, ...],
                  fold: jax.Array | None = None) -> jax.Array:
    """Uniform scores shared by all replicas (compressed sync, ``replica_selection="random"``):
    a function of (seed, step, matrix id[, shard]) only, so every replica picks the same rows."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), count), uid)
    if fold is not None:
        key = jax.random.fold_in(key, fold)
    return jax.random.uniform(key, shape, jnp.float32)


def top_rows(scores: jax.Array, k: int) -> jax.Array:
    """Indices ``(batch, k)`` of the ``k`` largest scores of each batch element.

    ``lax.top_k`` is deterministic; ties go to the lower index.
    """
    return jax.lax.top_k(scores, k)[1]


def take_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
    """``x[b, idx[b, j]]`` for a ``(batch, n)`` array and in-range ``(batch, k)`` indices (one
    gather, no index wrapping: ``jnp.take_along_axis`` with ``mode="promise_in_bounds"``)."""
    return gather_rows(x[:, :, None], idx, 1)[:, :, 0]


def gather_rows(m: jax.Array, idx: jax.Array, row_axis: int) -> jax.Array:
    """Rows ``idx`` (``(batch, k)``, in range) of each batch element of ``m``: one gather, with
    no negative-index wrapping."""
    dn = jax.lax.GatherDimensionNumbers(
        offset_dims=(3 - row_axis,), collapsed_slice_dims=(row_axis,),
        start_index_map=(row_axis,), operand_batching_dims=(0,), start_indices_batching_dims=(0,))
    sizes = [1, 1, 1]
    sizes[3 - row_axis] = m.shape[3 - row_axis]
    return jax.lax.gather(m, idx[:, :, None], dn, tuple(sizes),
                          mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)


def scatter_rows(m: jax.Array, idx: jax.Array, rows: jax.Array, row_axis: int,
                 mode: str | None = None) -> jax.Array:
    """``m`` with rows ``idx`` replaced by ``rows`` (same layout as :func:`gather_rows`).

    With ``mode="drop"``, out-of-range indices (distinct ones: padding of a short shard) are
    skipped. The step writes rows back with :func:`expand_rows` instead; this scatter is its
    reference in the tests and its alternative in ``benchmarks/bench_selection.py``.
    """
    rows = rows.astype(m.dtype)
    if row_axis == 1:
        return jax.vmap(lambda x, i, r: x.at[i].set(r, unique_indices=True, mode=mode))(
            m, idx, rows)
    return jax.vmap(lambda x, i, r: x.at[:, i].set(r, unique_indices=True, mode=mode))(
        m, idx, rows)


def batched_top_rows(requests: list[tuple[jax.Array, int]], ascending: bool = False
                     ) -> list[jax.Array]:
    """:func:`top_rows` for many ``(scores, k)`` pairs, one ``lax.top_k`` per distinct
    ``(n, k, dtype)``: the scores of a group are concatenated along the batch axis.

    A large ``k`` makes ``top_k`` a sort on GPU, which costs about the same for one row of scores
    as for many, so a model's 56 matrices of three shapes take three sorts instead of 56.
    With ``ascending``, each batch element's indices come sorted ascending (one sort per
    ``top_k`` as well).
    """
    groups: dict[tuple, list[int]] = {}
    for i, (row_scores, k) in enumerate(requests):
        groups.setdefault((row_scores.shape[1], k, jnp.dtype(row_scores.dtype)), []).append(i)
    out: dict[int, jax.Array] = {}
    for (_, k, _), members in groups.items():
        sizes = [requests[i][0].shape[0] for i in members]
        scores = [requests[i][0] for i in members]
        idx = top_rows(scores[0] if len(members) == 1 else jnp.concatenate(scores), k)
        if ascending:
            idx = jnp.sort(idx, axis=1)
        for i, part in zip(members, jnp.split(idx, list(itertools.accumulate(sizes))[:-1])):
            out[i] = part
    return [out[i] for i in range(len(requests))]


def rows_per_device(top: jax.Array, width: int, devices: int) -> jax.Array:
    """``(batch, devices)``: how many of the global rows ``top`` (``(batch, k)``, indices into
    ``devices`` row ranges of ``width`` each) lie in each device's range."""
    owner = top // width
    return jnp.sum(owner[..., None] == jnp.arange(devices, dtype=owner.dtype), axis=1,
                   dtype=jnp.int32)


def row_positions(idx: jax.Array, n: int) -> jax.Array:
    """``(batch, n)`` int32: the position of each row in ``idx`` (``(batch, k)``), ``k`` for rows
    not selected; out-of-range (padding) indices are ignored."""
    batch, k = idx.shape
    pos = jnp.full((batch, n), k, jnp.int32)
    arange = jnp.arange(k, dtype=jnp.int32)
    return jax.vmap(lambda p, i: p.at[i].set(arange, unique_indices=True, mode="drop"))(pos, idx)


def row_sources(pos: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """What :func:`place_rows` reads for each row of a block: ``(source, keep)``, both shaped
    like ``pos`` (:func:`row_positions`): the selected row to take (clamped into ``[0, k)``)
    and whether to take it (False: the base row stays)."""
    return jnp.minimum(pos, k - 1), pos < k


def place_rows(rows: jax.Array, sources: tuple[jax.Array, jax.Array], row_axis: int,
               base: jax.Array | None = None) -> jax.Array:
    """:func:`expand_rows` from precomputed :func:`row_sources` (one gather of whole rows and a
    select), so that blocks sharing their selection share its index work too."""
    src, keep = sources
    full = gather_rows(rows, src, row_axis)
    if base is not None:
        full = full.astype(base.dtype)
    keep = jax.lax.broadcast_in_dim(keep, full.shape, (0, row_axis))
    return jax.lax.select(keep, full, jnp.zeros_like(full) if base is None else base)


def expand_rows(rows: jax.Array, pos: jax.Array, row_axis: int,
                base: jax.Array | None = None) -> jax.Array:
    """The inverse of :func:`gather_rows` without a scatter: an ``n``-row block whose row ``r`` is
    ``rows[pos[r]]`` where ``pos[r] < k`` and ``base``'s row ``r`` (zero without ``base``)
    elsewhere.

    A gather of whole rows plus a select, so the result is written once, densely; equal to
    ``scatter_rows(base, idx, rows, row_axis, mode="drop")`` for ``pos = row_positions(idx, n)``.
    """
    return place_rows(rows, row_sources(pos, rows.shape[row_axis]), row_axis, base)


def local_positions(starts, counts, width: int, shard_index) -> tuple[jax.Array, jax.Array]:
    """This device's ``(start, count)`` of a row segment, from static per-device tables."""
    if all(s == starts[0] for s in starts) and all(c == counts[0] for c in counts):
        return jnp.int32(starts[0]), jnp.int32(counts[0])
    table = jnp.asarray([starts, counts], jnp.int32)
    return table[0, shard_index], table[1, shard_index]


def segment_scores(scores: jax.Array, start, count, width: int, shifted: bool) -> jax.Array:
    """``width`` rows of ``scores`` (``(batch, n_local)``) from ``start``; rows ≥ ``count`` → −inf.

    ``shifted`` (static): False when ``start`` is 0 on every device.
    """
    n_local = scores.shape[1]
    if shifted or width != n_local:
        scores = jnp.pad(scores, ((0, 0), (0, width)))
        scores = jax.lax.dynamic_slice_in_dim(scores, start, width, axis=1)
    valid = jnp.arange(width) < count
    return jnp.where(valid[None, :], scores, -jnp.inf)
