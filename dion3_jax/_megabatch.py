"""Megabatching: one batched orthogonalizer call per group of same-shape matrices.

The static plan groups the selected submatrices of all leaves by (wide shape, dtype); each group
is concatenated along the batch axis, orthogonalized with one call, and split back. On one device
this turns O(depth) polar calls into O(number of distinct shapes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp


def _to_wide(s: jax.Array) -> tuple[jax.Array, bool]:
    """Orients a (batch, a, b) block so that a ≤ b; polar(Sᵀ) = polar(S)ᵀ."""
    if s.shape[1] > s.shape[2]:
        return jnp.swapaxes(s, 1, 2), True
    return s, False


def group_plan(blocks: Sequence[jax.Array]) -> dict[tuple, list[int]]:
    """Static grouping of blocks by (wide matrix shape, dtype), in first-seen order."""
    groups: dict[tuple, list[int]] = {}
    for i, s in enumerate(blocks):
        a, b = sorted(s.shape[1:])
        groups.setdefault(((a, b), jnp.dtype(s.dtype)), []).append(i)
    return groups


def orthogonalize_blocks(blocks: Sequence[jax.Array],
                         orthogonalizer: Callable[[jax.Array], jax.Array]) -> list[jax.Array]:
    """Applies ``orthogonalizer`` to every matrix of every block, one call per shape group.

    Args:
      blocks: 3-D arrays ``(batch, rows, cols)``; each batch element is an independent matrix.
      orthogonalizer: maps a ``(batch, rows, cols)`` array with rows ≤ cols to its polar factors.

    Returns:
      The orthogonalized blocks, in the input order and orientation.
    """
    out: list[jax.Array | None] = [None] * len(blocks)
    for members in group_plan(blocks).values():
        wide = [_to_wide(blocks[i]) for i in members]
        stacked = wide[0][0] if len(wide) == 1 else jnp.concatenate([w for w, _ in wide], axis=0)
        result = orthogonalizer(stacked)
        if result.shape != stacked.shape:
            raise ValueError(f"the orthogonalizer changed the shape {stacked.shape} into "
                             f"{result.shape}")
        offset = 0
        for i, (w, swapped) in zip(members, wide):
            piece = jax.lax.slice_in_dim(result, offset, offset + w.shape[0], axis=0)
            offset += w.shape[0]
            out[i] = jnp.swapaxes(piece, 1, 2) if swapped else piece
    return out  # type: ignore[return-value]
