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
"""The random bits of a 16-bit momentum's stochastic rounding, keyed per step, leaf and element.

A bfloat16 or float16 momentum is rounded stochastically wherever the step writes it
(``S = d ⊙ M + G`` and the error feedback's ``μ·S``;
:func:`pallas_kernels._stochastic_rounding.stochastic_round`). Its bits are the counter hash
(:mod:`pallas_kernels._counter_hash`) of the element's global index under a key folded (by
``jax.random``'s Threefry ``fold_in``, once per write) from ``MeshOptions.seed``, the step
count, the leaf's position among the gradients' leaves and the write (:data:`SUM`,
:data:`DECAY`). So a
run is reproducible, and one step's bits are the same on one device and on any mesh: a device
offsets its shard's indices by the shard's position in the leaf. The counter's two words are an
element's row-major index over all axes but the last (modulo 2³²: leaves of more than 2³²
rows' worth of leading axes repeat bits) and its index along the last axis.

:func:`block_counters` describes the same bits per canonical block
(:meth:`dion3_jax._layout.LeafLayout.to_blocks`) as a
:class:`pallas_kernels._counter.RowCounter` (each row's words and their step along the row), for
the statistics kernel to hash itself; a block whose words do not step evenly along its rows
has none, and its pass runs in XLA.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from dion3_jax._distributed import spec_entries
from dion3_jax._layout import LeafLayout
from pallas_kernels._counter import RowCounter
from pallas_kernels._stochastic_rounding import STOCHASTIC_DTYPES, random_bits

#: The writes of one step, each with bits of its own.
SUM, DECAY = 0, 1

#: Separates these keys from the random row scores' (:func:`dion3_jax._selection.random_scores`).
_DOMAIN = 0x6D75


def stochastic(dtype) -> bool:
    """Whether a momentum of ``dtype`` is rounded stochastically (bfloat16 and float16)."""
    return jnp.dtype(dtype) in STOCHASTIC_DTYPES


def step_key(seed: int, count: jax.Array, leaf: int, write: int) -> jax.Array:
    """The ``(2,)`` uint32 key of one write of one leaf's momentum at step ``count``."""
    key = jax.random.key(seed, impl="threefry2x32")
    for x in (_DOMAIN, count, leaf, write):
        key = jax.random.fold_in(key, x)
    return jax.random.key_data(key)


def step_keys(seed: int, count: jax.Array, write: int, leaves: int) -> jax.Array:
    """:func:`step_key` of every leaf ``0 … leaves − 1`` at once: ``(leaves, 2)`` uint32.

    The same keys, folded for all leaves in one batched Threefry hash: a step that called
    :func:`step_key` once per leaf would put two Threefry hashes per leaf and write into its
    program, whose compile time grows with each (about 0.4 s per leaf on a GPU).
    """
    key = jax.random.key(seed, impl="threefry2x32")
    for x in (_DOMAIN, count):
        key = jax.random.fold_in(key, x)
    fold = lambda leaf: jax.random.fold_in(jax.random.fold_in(key, leaf), write)  # noqa: E731
    return jax.random.key_data(jax.vmap(fold)(jnp.arange(leaves, dtype=jnp.uint32)))


def _offset(axes: tuple[str, ...], extent: int) -> jax.Array | int:
    """This device's first index along a leaf axis sharded over mesh ``axes`` (none: 0)."""
    return jax.lax.axis_index(axes) * extent if axes else 0


def momentum_bits(key: jax.Array, shape: tuple[int, ...], spec: P = P()) -> jax.Array:
    """uint32 random bits for this device's shard of a leaf's momentum.

    Args:
      key: the write's ``(2,)`` uint32 key (:func:`step_key`: the run's seed, the step count,
        the leaf's position among the gradients' leaves and :data:`SUM` or :data:`DECAY`).
      shape: the local shard's shape.
      spec: the leaf's ``PartitionSpec`` (``P()`` without a mesh); inside ``shard_map`` a
        shard's elements take their global indices from it.

    Returns:
      Bits shaped ``shape``, equal for an element whatever the mesh.
    """
    entries = spec_entries(spec, len(shape))
    coef = _coefficients(_global_sizes(entries, shape))
    words: list[jax.Array] = [jnp.uint32(0), jnp.uint32(0)]
    for a, (e, n) in enumerate(zip(entries, shape)):
        # Each axis's index at its own rank, so that a word is formed (and hashed) at the
        # shape of the axes it counts (``hi``: all but the last; ``lo``: the last).
        axis = [1] * len(shape)
        axis[a] = n
        i = (jax.lax.broadcasted_iota(jnp.uint32, tuple(axis), a)
             + jnp.asarray(_offset(e, n), jnp.uint32))
        words = [w + (i if c == 1 else i * np.uint32(c)) if c else w
                 for w, c in zip(words, coef[a])]
    bits = random_bits(key, *words)
    return jnp.broadcast_to(bits, shape)


def _global_sizes(entries, shape: tuple[int, ...]) -> list[int]:
    """The leaf's global sizes: the shard's ``shape`` times the mesh axes it is sharded on."""
    return [n * (math.prod(jax.lax.axis_size(a) for a in e) if e else 1)
            for e, n in zip(entries, shape)]


def _coefficients(sizes: list[int]) -> list[tuple[int, int]]:
    """Per leaf axis of global ``sizes``, what one step along it adds to the ``(hi, lo)``
    words (modulo 2³²): ``hi`` is the row-major index over all axes but the last, ``lo`` the
    index along the last."""
    out = [(0, 1)]
    stride = 1
    for n in reversed(sizes[:-1]):
        out.insert(0, (stride, 0))
        stride = stride * n % 2 ** 32
    return out


def _row_step(axes: list[int], local: tuple[int, ...], coef) -> tuple[int, int] | None:
    """The ``(hi, lo)`` step along a block's summed axis, which runs over the leaf ``axes`` in
    row-major order (``local``: the shard's sizes), or None where it is not one step."""
    kept = [a for a in axes if local[a] > 1]
    if not kept:
        return (0, 0)
    step = coef[kept[-1]]
    run = 1
    for a in reversed(kept):
        if any((step[w] * run - coef[a][w]) % 2 ** 32 for w in (0, 1)):
            return None
        run *= local[a]
    return step


def _digit_words(flat: jax.Array, axes: list[int], local: tuple[int, ...], coef,
                 ) -> list[jax.Array]:
    """The ``(hi, lo)`` words that a row-major index ``flat`` over the leaf ``axes`` adds."""
    words = [jnp.zeros_like(flat), jnp.zeros_like(flat)]
    for a in reversed(axes):
        digit = flat % np.uint32(local[a])
        flat = flat // np.uint32(local[a])
        for w in (0, 1):
            words[w] = words[w] + digit * np.uint32(coef[a][w])
    return words


def block_words(local: LeafLayout, spec: P = P()
                ) -> tuple[list[jax.Array], tuple[int, int] | None, bool]:
    """The key-free part of :func:`block_counters`: per block of the local shard, each row's
    ``(batch, 2, n)`` words at its first element, the ``(hi, lo)`` step along the rows (None
    where the words do not step evenly), and whether the stepping word starts at the same value
    on every row of a matrix (the counters' ``common_start``: no row axis adds to it). Leaves
    of one layout and spec share them."""
    shape = local.shape
    entries = spec_entries(spec, len(shape))
    coef = _coefficients(_global_sizes(entries, shape))
    base = [jnp.uint32(0), jnp.uint32(0)]
    for a, e in enumerate(entries):
        off = jnp.asarray(_offset(e, shape[a]), jnp.uint32)
        base = [base[w] + off * np.uint32(coef[a][w]) for w in (0, 1)]
    nb, nf = len(local.batch_shape), len(local.first_shape)
    groups = [list(local.perm[:nb]), list(local.perm[nb:nb + nf]), list(local.perm[nb + nf:])]
    rows_axes, summed_axes = (groups[2], groups[1]) if local.out_last else groups[1:]
    heads, words, start = local.num_heads, [], 0
    for bl, n in zip(local.blocks, local.split_sizes):
        k = jax.lax.broadcasted_iota(jnp.uint32, (bl.batch, n), 0)
        r = jax.lax.broadcasted_iota(jnp.uint32, (bl.batch, n), 1)
        row = (k % np.uint32(heads)) * np.uint32(n) + r + np.uint32(start)
        words.append(jnp.stack([b + x + y for b, x, y in zip(
            base, _digit_words(k // np.uint32(heads), groups[0], shape, coef),
            _digit_words(row, rows_axes, shape, coef))], 1))
        start += n
    step = _row_step(summed_axes, shape, coef)
    common = step is not None and not any(
        coef[a][w] for a in rows_axes if shape[a] > 1 for w in (0, 1) if step[w])
    return words, step, common


def block_counters(key: jax.Array, local: LeafLayout, spec: P = P(), words=None,
                   leaf: int | None = None) -> list[RowCounter | None]:
    """The counters of :func:`momentum_bits`'s bits in this device's blocks of a leaf.

    Args:
      key: the write's key, as :func:`momentum_bits`; with ``leaf``, every leaf's keys
        (:func:`step_keys`), of which the counters take row ``leaf``.
      local: the layout of the local shard (its :meth:`~LeafLayout.to_blocks`).
      spec: the leaf's ``PartitionSpec``, as :func:`momentum_bits`.
      words: :func:`block_words` of ``local`` and ``spec``, when the caller has them already
        (another leaf of the same layout made them).
      leaf: the leaf's position among the gradients' leaves, for a table ``key``: the kernels
        then read the leaf's key from the table (one buffer for every leaf's kernel).

    Returns:
      Per block, a :class:`pallas_kernels._counter.RowCounter` whose
      :func:`pallas_kernels._counter.counter_bits` are ``local.to_blocks(momentum_bits(...))``'s
      block, or None where the block's words do not step evenly along its rows (reduction
      axes whose steps in the counter's words do not chain, e.g. across a sharded axis).
    """
    rows, step, common = block_words(local, spec) if words is None else words
    index = None if leaf is None else jnp.asarray(np.full((1,), leaf, np.int32))
    return [None if step is None else RowCounter(key, w, step, index, common) for w in rows]
