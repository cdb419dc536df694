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
"""The lower-triangular tile walk of a symmetric product (pure index maths).

An ``n × n`` symmetric output cut into ``T × T`` square tiles has ``T(T+1)/2`` tiles on or below the
diagonal. A kernel walks them with one linear index ``t`` and needs ``t → (i, j)`` with ``i ≥ j``
computed cheaply inside the kernel, from integer division, remainder and one select only (no square
root, which would need float maths and fix-ups). The Triton kernel walks single tiles
(:func:`lower_tile_coords`); the Mosaic kernel walks pairs of tiles that share a column panel
(:func:`pair_tile_coords`, below).

The walk folds the triangle into a ``⌈T/2⌉ × (T+1)`` rectangle: row ``q`` of the rectangle holds
tile row ``T-1-q`` (``T-q`` tiles) followed by tile row ``q`` (``q+1`` tiles), ``T+1`` tiles in all.
For odd ``T`` the middle tile row ``(T-1)/2`` is the last, half-filled rectangle row, and the same
formula covers it. Each rectangle row pairs a long tile row with a short one, so consecutive linear
indices share their row operand (good for L2) and the work per rectangle row is constant.

Every function here accepts Python ints, NumPy integer arrays or traced JAX int32 scalars.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def num_lower_tiles(tiles_per_side: int) -> int:
    """Number of tiles on or below the diagonal of a ``T × T`` tile grid: ``T(T+1)/2``."""
    if tiles_per_side < 0:
        raise ValueError(f"{tiles_per_side=} must be >= 0")
    return tiles_per_side * (tiles_per_side + 1) // 2


def _select(pred: Any, on_true: Any, on_false: Any) -> Any:
    """``where`` that works for Python bools, NumPy arrays and JAX tracers."""
    if isinstance(pred, (bool, np.bool_)):
        return on_true if pred else on_false
    if isinstance(pred, np.ndarray):
        return np.where(pred, on_true, on_false)
    from jax import lax  # Local import: keeps this module importable without jax.

    return lax.select(pred, on_true, on_false)


def _divmod(a: Any, b: int) -> tuple[Any, Any]:
    """Non-negative ``divmod`` that lowers to one integer division and remainder for JAX values."""
    if isinstance(a, (int, np.integer, np.ndarray)):
        return a // b, a % b
    from jax import lax

    divisor = lax.convert_element_type(b, a.dtype)
    return lax.div(a, divisor), lax.rem(a, divisor)


def lower_tile_coords(t: Any, tiles_per_side: int) -> tuple[Any, Any]:
    """Maps a linear index ``0 <= t < T(T+1)/2`` to the tile ``(i, j)``, ``i >= j``.

    Args:
      t: linear tile index (Python int, NumPy integer array or traced int32 scalar).
      tiles_per_side: ``T``, the number of tiles along each side of the output (static).

    Returns:
      ``(i, j)``: row and column tile indices with ``0 <= j <= i < T``; each lower tile is
      produced by exactly one ``t``.
    """
    width = tiles_per_side + 1
    q, s = _divmod(t, width)
    long_len = tiles_per_side - q  # Length of tile row T-1-q.
    in_long_row = s < long_len
    i = _select(in_long_row, tiles_per_side - 1 - q, q)
    j = _select(in_long_row, s, s - long_len)
    return i, j


# --- Paired walk: two tiles per work item that share their column panel --------------------------
#
# A work item ``(c, r1, r2)`` stands for the tiles ``{r1, c}`` and ``{r2, c}`` (unordered: the
# kernel computes ``out[r, c] = x_r · x_cᵀ`` and stores it and its mirror, so an upper tile
# ``r < c`` is as good as the lower one). Both tiles read the column panel ``c``, so a CTA whose two
# compute warpgroups own one tile each loads three panels per step for two tiles (1.5 per tile
# instead of 2).
# ``r2 == r1`` marks a single (the second warpgroup's result is discarded); there are at most two
# singles per matrix (none when ``T % 4 == 0``), so ``T = 32`` gives ``264 = 2 × 132`` items.
#
# Sections, in walk order (``h = T // 2`` super-panels of two tiles, ``Q = h // 2`` quads):
#   S1  the ``Q`` diagonal 4×4-tile blocks (10 tiles each) as 5 items (table ``_QUAD``);
#   S2  every other 2×2 block below the diagonal inside the first ``4Q`` panels, 2 items each
#       (column ``2J`` and ``2J+1``, rows ``2I, 2I+1``), walked by row pairs ``(2u, 2u+1)``;
#   S3  when ``h`` is odd: super-row ``I = 2Q`` (its ``2Q`` off-diagonal blocks, then its diagonal
#       block as ``(2I; 2I, 2I+1)`` and the single ``(2I+1; 2I+1)``);
#   S4  when ``T`` is odd: tile row ``p = T-1`` as ``(p; 2v, 2v+1)`` and the single ``(p; p)``.

# (column, row 1, row 2) offsets inside a diagonal 4×4-tile block; covers its 10 lower tiles.
_QUAD = ((0, 0, 1), (0, 2, 3), (1, 1, 2), (2, 2, 3), (3, 3, 1))


def num_pair_items(tiles_per_side: int) -> int:
    """Number of paired work items for a ``T × T`` tile grid (about ``T(T+1)/4``)."""
    t = tiles_per_side
    if t < 0:
        raise ValueError(f"{tiles_per_side=} must be >= 0")
    h = t // 2
    q = h // 2
    n = 5 * q + 4 * q * (q - 1)
    if h % 2:
        n += 4 * q + 2
    if t % 2:
        n += (t + 1) // 2
    return n


def _min(a: Any, b: Any) -> Any:
    return _select(a < b, a, b)


def pair_tile_coords(m: Any, tiles_per_side: int) -> tuple[Any, Any, Any]:
    """Maps ``0 <= m < num_pair_items(T)`` to the work item ``(c, r1, r2)``.

    Args:
      m: linear item index (Python int, NumPy integer array or traced int32 scalar).
      tiles_per_side: ``T`` (static).

    Returns:
      ``(c, r1, r2)``: the shared column panel and the two row panels; the item covers the
      unordered tiles ``{r1, c}`` and ``{r2, c}`` (one tile when ``r1 == r2``). Every tile on or
      below the diagonal is covered by exactly one item.
    """
    t = tiles_per_side
    h = t // 2
    q = h // 2
    sections = []  # (start, (c, r1, r2)) evaluated for every m, chosen by a select chain.
    start = 0
    if q:  # S1
        qi, s = _divmod(_min(m, 5 * q - 1), 5)
        base = 4 * qi
        c = r1 = r2 = 0
        for k, (dc, d1, d2) in enumerate(_QUAD):
            hit = s == k
            c, r1, r2 = (_select(hit, base + dc, c), _select(hit, base + d1, r1),
                         _select(hit, base + d2, r2))
        sections.append((start, (c, r1, r2)))
        start += 5 * q
    if q > 1:  # S2
        n2 = 4 * q * (q - 1)
        mm = _min(_select(m >= start, m - start, 0 * m), n2 - 1)
        b, which = _divmod(mm, 2)
        b4, s4 = _divmod(b, 4)
        v, w = lower_tile_coords(b4, q - 1)
        u2 = 2 * (v + 1)  # Rows 2u and 2u+1 of super-blocks hold 2u blocks each.
        e = 4 * w + s4
        second_row = e >= u2
        big_i = u2 + _select(second_row, 1 + 0 * e, 0 * e)
        big_j = _select(second_row, e - u2, e)
        sections.append((start, (2 * big_j + which, 2 * big_i, 2 * big_i + 1)))
        start += n2
    if h % 2:  # S3
        big_i = 2 * q
        mm = _min(_select(m >= start, m - start, 0 * m), 4 * q + 1)
        in_blocks = mm < 4 * q
        b, which = _divmod(_min(mm, max(4 * q - 1, 0)), 2)
        tail = mm - 4 * q
        c = _select(in_blocks, 2 * b + which, 2 * big_i + tail)
        r1 = _select(in_blocks, 2 * big_i + 0 * mm, 2 * big_i + tail)
        sections.append((start, (c, r1, 2 * big_i + 1 + 0 * mm)))
        start += 4 * q + 2
    if t % 2:  # S4
        p = t - 1
        mm = _select(m >= start, m - start, 0 * m)
        sections.append((start, (p + 0 * mm, _min(2 * mm, p), _min(2 * mm + 1, p))))
    c, r1, r2 = sections[0][1]
    for sec_start, (sc, s1, s2) in sections[1:]:
        later = m >= sec_start
        c, r1, r2 = _select(later, sc, c), _select(later, s1, r1), _select(later, s2, r2)
    return c, r1, r2


def batched_pair_tile_coords(m: Any, tiles_per_side: int) -> tuple[Any, Any, Any, Any]:
    """Like :func:`pair_tile_coords` over ``batch · num_pair_items(T)`` items.

    Returns:
      ``(b, c, r1, r2)``: batch index and the work item.
    """
    per_matrix = num_pair_items(tiles_per_side)
    b, m = _divmod(m, per_matrix)
    return (b, *pair_tile_coords(m, tiles_per_side))
