"""The lower-triangular tile walk of a symmetric product (pure index maths).

An ``n × n`` symmetric output cut into ``T × T`` square tiles has ``T(T+1)/2`` tiles on or below the
diagonal. The kernels walk them with one linear index ``t`` and need ``t → (i, j)`` with ``i ≥ j``
computed cheaply inside the kernel, from integer division, remainder and one select only (no square
root, which would need float maths and fix-ups).

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


def num_tiles(size: int, tile: int) -> int:
    """Number of tiles of side ``tile`` along an axis of length ``size`` (ceiling division)."""
    if size < 0 or tile <= 0:
        raise ValueError(f"need size >= 0 and tile > 0, got {size=} {tile=}")
    return -(-size // tile)


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

    b = lax.convert_element_type(b, a.dtype)
    return lax.div(a, b), lax.rem(a, b)


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


def batched_lower_tile_coords(t: Any, tiles_per_side: int) -> tuple[Any, Any, Any]:
    """Like :func:`lower_tile_coords` for a batch walked one matrix after another.

    Args:
      t: linear index over ``batch · T(T+1)/2`` tiles.
      tiles_per_side: ``T`` (static).

    Returns:
      ``(b, i, j)``: batch index and tile indices.
    """
    per_matrix = num_lower_tiles(tiles_per_side)
    b, t = _divmod(t, per_matrix)
    i, j = lower_tile_coords(t, tiles_per_side)
    return b, i, j


def lower_tile_table(tiles_per_side: int) -> np.ndarray:
    """All lower tiles in walk order: an int32 array of shape ``(T(T+1)/2, 2)`` (for tests)."""
    t = np.arange(num_lower_tiles(tiles_per_side), dtype=np.int64)
    i, j = lower_tile_coords(t, tiles_per_side)
    return np.stack([i, j], axis=-1).astype(np.int32)
