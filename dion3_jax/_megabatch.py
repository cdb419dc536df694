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
"""Megabatching: one batched orthogonalizer call (and one all-to-all each way) per shape group.

The static plan groups the selected submatrices ("payloads") of all leaves by (shape, dtype,
how they are distributed). Each group is concatenated along its batch axis and then, inside the
step's ``shard_map``:

* ``"all_to_all"`` (row- or column-sharded matrices): the count is padded with zero matrices to a
  multiple of the axis size ``W``; ONE ``lax.all_to_all`` sends matrix ``j`` of every device to
  device ``j // (N/W)``, which concatenates the pieces into whole matrices; the device
  orthogonalizes its ``N/W`` matrices in one call; ONE ``all_to_all`` sends the pieces back.
* ``"split"`` (replicated matrices, pure data parallel): the padded batch is split across the
  axis, each device orthogonalizes its slice, ``all_gather`` reassembles the batch.
* ``"on_device"`` (whole matrices already on the device: one device, or a batch-sharded leaf):
  one orthogonalizer call.

On one device every group is ``"on_device"`` and this is exactly "one polar call per shape".
Zero matrices (and zero rows) stay exactly zero through Newton-Schulz, so padding never changes the
real results.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import itertools
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


Route = Literal["on_device", "split", "all_to_all"]


class GroupKey(NamedTuple):
    """Static identity of a shape group.

    Attributes:
      route: how the group's matrices reach the orthogonalizer: ``"on_device"``, ``"split"`` or
        ``"all_to_all"`` (see the module docstring).
      axes: mesh axes of the collective (empty for ``"on_device"``).
      concat_axis: ``"all_to_all"``: the payload axis (1 or 2) along which pieces are
        concatenated into whole matrices.
      shape: the payload's (rows, cols) on the sending device, in the orientation the
        orthogonalizer gets (the leaf's own, or wide for one that takes only wide matrices).
      dtype: the payload dtype.
      kept: ``"all_to_all"`` of global-scope row shards: the rows of the assembled matrix that
        the orthogonalizer gets, the ``k`` selected ones in order (every device sends
        ``min(k, rows per device)``, the rest zero padding); 0: all of them.
      col_pieces: ``"all_to_all"`` of row shards that are column tiles too: the number of
        column pieces (the minor part of ``axes``); the assembled matrix takes the pieces of
        ``axes`` as a grid, rows major. 1: pieces along ``concat_axis`` only.
    """

    route: Route
    axes: tuple[str, ...]
    concat_axis: int
    shape: tuple[int, int]
    dtype: jnp.dtype
    kept: int = 0
    col_pieces: int = 1


def _pad_count(x: jax.Array, multiple: int) -> jax.Array:
    pad = (-x.shape[0]) % multiple
    if pad:
        x = jnp.concatenate([x, jnp.zeros((pad, *x.shape[1:]), x.dtype)], axis=0)
    return x


def checked(orthogonalize, x):
    """``orthogonalize(x)``, whose result must have the stacked shape of ``x`` (an array, or a
    list of arrays stacked along axis 0)."""
    y = orthogonalize(x)
    shape = x.shape if hasattr(x, "shape") else (sum(p.shape[0] for p in x), *x[0].shape[1:])
    if y.shape != shape:
        raise ValueError(f"the orthogonalizer changed the shape {shape} into {y.shape}")
    return y


def _kept_rows(counts: jax.Array, sent: int, kept: int):
    """Where the ``kept`` selected rows lie in assembled matrices of ``W`` pieces of ``sent``
    rows, piece ``d`` holding ``counts[:, d]`` of them first (in order), and the inverse.

    Returns:
      ``(slots, sources, keep)``: ``(per, kept)``, the assembled row of each kept row;
      ``(per, W·sent)``, the kept row each assembled row takes and whether it takes one.
    """
    w = counts.shape[1]
    ends = jnp.cumsum(counts, axis=1)
    starts = ends - counts
    p = jnp.arange(kept, dtype=counts.dtype)
    piece = jnp.minimum(jnp.sum(ends[:, None, :] <= p[None, :, None], axis=2), w - 1)
    slots = piece * sent + p - jnp.take_along_axis(starts, piece, axis=1)
    t = jnp.arange(w * sent, dtype=counts.dtype)
    within = t % sent
    sources = starts[:, t // sent] + within
    keep = within < counts[:, t // sent]
    return jnp.clip(slots, 0, w * sent - 1), jnp.minimum(sources, kept - 1), keep


def kept_rows(x: jax.Array, counts: jax.Array, kept: int) -> jax.Array:
    """``(batch, kept)``: the entries of ``x`` (``(batch, W·sent)``: ``W`` pieces of ``sent``,
    piece ``d`` holding ``counts[:, d]`` kept entries first) that are kept, in order."""
    sent = x.shape[1] // counts.shape[1]
    return jnp.take_along_axis(x, _kept_rows(counts, sent, kept)[0], axis=1)


def _along(index: jax.Array, axis: int) -> jax.Array:
    """A ``(per, m)`` index broadcast to take along ``axis`` (1 or 2) of a 3-D array."""
    return jnp.expand_dims(index, 3 - axis)


def orthogonalize_group(x: jax.Array, key: GroupKey, axis_size: int,
                        orthogonalizer: Callable[[jax.Array], jax.Array],
                        counts: jax.Array | None = None) -> jax.Array:
    """Orthogonalizes a stacked group ``(N, a, b)`` of local payloads; returns the local pieces.

    Args:
      x: the group's payloads stacked along axis 0 (local to the device, inside shard_map).
      key: the group's static key.
      axis_size: number of devices along ``key.axes``.
      orthogonalizer: ``(batch, rows, cols) -> polar factors``.
      counts: with ``key.kept``, ``(N, W)`` int32: how many selected rows each device's piece
        of each matrix holds (first, in order); the orthogonalizer then gets only those,
        ``key.kept`` per matrix, as on one device, and zero padding goes back in their place.

    Returns:
      An array shaped like ``x``: the device's pieces of the orthogonalized matrices.
    """
    n = x.shape[0]
    if key.route == "on_device" or axis_size == 1:
        return checked(orthogonalizer, x)
    xp = _pad_count(x, axis_size)
    if key.route == "split":
        per = xp.shape[0] // axis_size
        start = jax.lax.axis_index(key.axes) * per
        mine = jax.lax.dynamic_slice_in_dim(xp, start, per, axis=0)
        out = jax.lax.all_gather(checked(orthogonalizer, mine), key.axes, axis=0, tiled=True)
        return out[:n]
    # all_to_all: (N_pad, a, b) pieces → (N_pad/W, whole) → polar → back. The exchange itself always
    # moves contiguous leading chunks (split and concat on axis 0; XLA:CPU rejects some layouts
    # of a concat on a minor axis); assembling the pieces along `concat_axis` is a local copy.
    w, per = axis_size, xp.shape[0] // axis_size
    a, b = xp.shape[1:]
    # The barrier keeps XLA:CPU from splitting the operand into per-peer pieces of different
    # provenance (its verifier then rejects the all-to-all when some pieces are padding).
    xp = jax.lax.optimization_barrier(xp)
    recv = jax.lax.all_to_all(xp, key.axes, 0, 0, tiled=True)
    whole = _assemble(recv.reshape((w, per, a, b)), key.concat_axis, key.col_pieces)
    if key.kept:
        if counts is None:
            raise ValueError("a group that keeps some rows (key.kept) needs their counts")
        mine = jax.lax.dynamic_slice_in_dim(_pad_count(counts, w),
                                            jax.lax.axis_index(key.axes) * per, per, axis=0)
        slots, sources, keep = _kept_rows(mine, xp.shape[key.concat_axis], key.kept)
        kept = jnp.take_along_axis(whole, _along(slots, key.concat_axis), axis=key.concat_axis)
        o = checked(orthogonalizer, kept)
        o = jnp.where(_along(keep, key.concat_axis), jnp.take_along_axis(
            o, _along(sources, key.concat_axis), axis=key.concat_axis), jnp.zeros((), o.dtype))
    else:
        o = checked(orthogonalizer, whole)
    pieces = _disassemble(o, key.concat_axis, key.col_pieces, (a, b))
    back = jax.lax.all_to_all(pieces.reshape((w * per, a, b)), key.axes, 0, 0, tiled=True)
    return back[:n]


def _assemble(recv: jax.Array, concat_axis: int, col_pieces: int) -> jax.Array:
    """``(W, per, a, b)`` pieces (device-major) → ``(per, ·, ·)`` whole matrices: the pieces
    of ``W / col_pieces`` row shards concatenated along ``concat_axis``, each made of
    ``col_pieces`` column pieces concatenated along the other axis."""
    w, per, a, b = recv.shape
    wr, wc = w // col_pieces, col_pieces
    grid = recv.reshape((wr, wc, per, a, b))
    if concat_axis == 1:     # rows of a: (per, wr, a, wc, b)
        return jnp.transpose(grid, (2, 0, 3, 1, 4)).reshape((per, wr * a, wc * b))
    return jnp.transpose(grid, (2, 1, 3, 0, 4)).reshape((per, wc * a, wr * b))


def _disassemble(o: jax.Array, concat_axis: int, col_pieces: int, piece: tuple[int, int]
                 ) -> jax.Array:
    """The inverse of :func:`_assemble`: ``(per, ·, ·)`` → ``(W, per, a, b)``."""
    per, (a, b) = o.shape[0], piece
    wc = col_pieces
    if concat_axis == 1:
        wr = o.shape[1] // a
        return jnp.transpose(o.reshape((per, wr, a, wc, b)), (1, 3, 0, 2, 4)).reshape(
            (wr * wc, per, a, b))
    wr = o.shape[2] // b
    return jnp.transpose(o.reshape((per, wc, a, wr, b)), (3, 1, 0, 2, 4)).reshape(
        (wr * wc, per, a, b))


def stack(payloads: Sequence[jax.Array]) -> jax.Array:
    """The arrays concatenated along axis 0 (one array: itself)."""
    return payloads[0] if len(payloads) == 1 else jnp.concatenate(payloads, axis=0)


def unstack(x: jax.Array, sizes: Sequence[int], computed_once: bool = False
            ) -> list[jax.Array]:
    """The inverse of :func:`stack`: consecutive pieces of ``sizes`` along axis 0.

    The offsets are runtime values (NumPy constants, cheap to trace, behind an optimization
    barrier), so that the kernels consuming the pieces of many same-shaped members are one
    program compiled once rather than one program per offset; each piece is a fused dynamic
    slice, as cheap as a static one.

    With ``computed_once``, ``x`` goes behind the barrier too: XLA materializes it instead of
    fusing the work that makes it into every piece's consumer (for small per-matrix arrays,
    whose work is then compiled and run once per stack; or for an ``x`` that is a kernel's
    output anyway). Each piece is then sliced from its own output of the barrier (the same
    buffer): the pieces' consumers share no operand, so XLA:GPU does not merge them into one
    multi-output fusion, which it would for slices at run-time offsets of one shared array
    (the merged fusion of a group's parameter updates runs slower than its parts).
    """
    if len(sizes) == 1:
        return [x]
    offsets = [np.int32(o) for o in itertools.accumulate(sizes, initial=0)][:-1]
    if computed_once:
        xs, offsets = jax.lax.optimization_barrier(([x] * len(sizes), offsets))
    else:
        xs, offsets = [x] * len(sizes), jax.lax.optimization_barrier(offsets)
    return [jax.lax.dynamic_slice_in_dim(piece, o, s, axis=0, allow_negative_indices=False)
            for piece, o, s in zip(xs, offsets, sizes)]
