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
"""The random bits of an array described by its counters, for a kernel to make them itself.

:func:`pallas_kernels._stochastic_rounding.random_bits` hashes two counter words per element.
An array of ``(batch, a, b)`` matrices whose words step by a fixed amount along the summed axis
(each row's elements are consecutive in the counter, as they are for a leaf's momentum,
:mod:`dion3_jax._rounding`) is described by a :class:`RowCounter`: the key, each row's words at
its first element, and the two words' steps along the row. The statistics pass's kernel reads
the rows' words (8 bytes a row) and hashes each element's words in registers, instead of
reading 4 bytes of precomputed bits per element (:func:`row_hash` and :func:`block_bits`: a
word that does not step along the rows is hashed once per row). :func:`counter_bits` is its
reference: every element's words from the same description, hashed by
:func:`pallas_kernels._counter_hash.counter_hash`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._counter_hash import finish, hi_line, lo_line, tweak
from pallas_kernels._stochastic_rounding import random_bits


@functools.partial(jax.tree_util.register_dataclass, data_fields=["key", "rows", "index"],
                   meta_fields=["steps", "common_start"])
@dataclasses.dataclass(frozen=True)
class RowCounter:
    """Counter words of every element of ``(batch, a, b)`` matrices, row by row.

    Element ``j`` of row ``i`` of matrix ``k`` (``j`` along the summed axis, the one that is not
    ``row_axis``) has the words ``(hi, lo) = rows[k, :, i] + j · steps`` (modulo 2³²).

    Attributes:
      key: ``(2,)`` uint32, the key's two words; or, with ``index``, a ``(keys, 2)`` table of
        keys of which row ``index[0]`` is this counter's.
      rows: ``(batch, 2, n)`` uint32, each row's ``(hi, lo)`` at its first element.
      steps: ``(hi, lo)`` steps along a row (Python ints, taken modulo 2³²; the pytree's
        static part, so that a jitted function compiles them in).
      index: None, or ``(1,)`` int32: the row of a table ``key``. A kernel reads the row
        itself, so that counters of one table (the leaves of one step) hand it the same
        buffer; a slice per counter would be a small XLA kernel of its own before each call.
      common_start: whether the words that step along the rows start at the same value on
        every row of a matrix (``rows[k, w, :]`` constant for each stepping word ``w``; static).
        A kernel then hashes those words once per index along the summed axis, on a vector,
        instead of once per element (:func:`summed_line`); the bits are the same. False
        promises nothing, True is the caller's promise (:func:`dion3_jax._rounding.block_words`
        derives it from the leaf's layout).
    """

    key: jax.Array
    rows: jax.Array
    steps: tuple[int, int]
    index: jax.Array | None = None
    common_start: bool = False


def check_counter(counter: RowCounter, batch: int, n: int) -> None:
    """Raises ``ValueError`` unless ``counter`` describes ``batch`` matrices of ``n`` rows."""
    key = jnp.shape(counter.key)
    if counter.index is None:
        ok_key = key == (2,)
    else:
        ok_key = (len(key) == 2 and key[1] == 2 and jnp.shape(counter.index) == (1,)
                  and jnp.issubdtype(jnp.result_type(counter.index), jnp.integer))
    if not ok_key or jnp.shape(counter.rows) != (batch, 2, n):
        index = None if counter.index is None else jnp.shape(counter.index)
        raise ValueError(f"the counter's key must be (2,), or a (keys, 2) table with a (1,) "
                         f"integer index, and its rows (batch, 2, n) = {(batch, 2, n)}; got "
                         f"key {key}, index {index} and rows {jnp.shape(counter.rows)}")
    if len(counter.steps) != 2 or not all(isinstance(s, int) for s in counter.steps):
        raise ValueError(f"the counter's steps must be two Python ints, got {counter.steps!r}")
    if not isinstance(counter.common_start, bool):
        raise ValueError(f"the counter's common_start must be a bool, got "
                         f"{counter.common_start!r}")


def counter_key(counter: RowCounter) -> jax.Array:
    """The counter's own ``(2,)`` uint32 key (its row of a table ``key``)."""
    key = counter.key.astype(jnp.uint32)
    return key if counter.index is None else key[counter.index[0]]


def key_table(counter: RowCounter) -> tuple[jax.Array, jax.Array]:
    """``(table, index)`` for a kernel: ``(keys, 2)`` uint32 keys and the ``(1,)`` int32 row
    of this counter's (a lone key is a table of one, row 0)."""
    if counter.index is None:
        return jnp.reshape(counter.key, (1, 2)).astype(jnp.uint32), jnp.zeros((1,), jnp.int32)
    return counter.key.astype(jnp.uint32), counter.index.astype(jnp.int32)


def step_words(steps: tuple[int, int]) -> tuple[np.uint32, np.uint32]:
    """The steps as uint32 constants (modulo 2³²)."""
    return np.uint32(steps[0] % 2 ** 32), np.uint32(steps[1] % 2 ** 32)


def element_words(first: Sequence[jax.Array], j: jax.Array, steps: tuple[int, int]
                  ) -> list[jax.Array]:
    """The ``(hi, lo)`` words of the elements at index ``j`` (uint32) along their rows, whose
    first elements' words are ``first`` (broadcastable against ``j``; a word that does not
    step keeps ``first``'s shape): what :func:`counter_bits` hashes."""
    out = []
    for w, step in zip(first, step_words(steps)):
        if step:
            w = w + (j if step == 1 else j * step)
        out.append(w)
    return out


#: The line hash of each word, ``(hi, lo)``.
_LINES = (hi_line, lo_line)


def row_hash(key: Sequence[jax.Array], rows: Sequence[jax.Array], steps: tuple[int, int]
             ) -> jax.Array | None:
    """The per-row part of :func:`block_bits`, for a kernel to compute once before its walk:
    the key's tweak xored with the line hash of each word that does not step along the rows
    (``steps`` 0 modulo 2³²), one value per row; None where both words step.

    Args:
      key: the key's two uint32 words (scalars).
      rows: the rows' ``(hi, lo)`` words at their first elements (vectors).
      steps: the counter's ``(hi, lo)`` steps along a row.
    """
    fixed = [line(k, w) for line, k, w, step in zip(_LINES, key, rows, step_words(steps))
             if not step]
    return functools.reduce(operator.xor, fixed, tweak(key[0], key[1])) if fixed else None


def summed_line(key: Sequence[jax.Array], start: Sequence[jax.Array], j: jax.Array,
                steps: tuple[int, int]) -> jax.Array | None:
    """The xor of the line hashes of the words that step along the rows, at index ``j`` along
    them, from their values ``start`` at a row's first element (a word that does not step is
    ignored): the per-element part of :func:`block_bits`. For a :class:`RowCounter` with
    ``common_start``, ``start`` is one matrix's scalars and ``j`` a vector along the summed
    axis, so each line hash is made once per index instead of once per element. None where no
    word steps."""
    lines = [line(k, w + (j if step == 1 else j * step))
             for line, k, w, step in zip(_LINES, key, start, step_words(steps)) if step]
    return functools.reduce(operator.xor, lines) if lines else None


def mix(key: Sequence[jax.Array], per_row: jax.Array | None, line: jax.Array | None
        ) -> jax.Array:
    """The bits from a block's two halves, the last step of :func:`block_bits`: the finalizer
    of ``per_row`` (:func:`row_hash`, broadcast to the block; None: the key's tweak) xored with
    ``line`` (:func:`summed_line`, broadcast to the block; None where no word steps)."""
    base = tweak(key[0], key[1]) if per_row is None else per_row
    return finish(base if line is None else base ^ line)


def block_bits(key: Sequence[jax.Array], rows: Sequence[jax.Array], per_row: jax.Array | None,
               j: jax.Array, steps: tuple[int, int], expand: Callable[[jax.Array], jax.Array]
               ) -> jax.Array:
    """The bits of a kernel's block, :func:`counter_bits`'s: only the words that step along
    the rows are formed and hashed per element; the rest is ``per_row``, broadcast.

    Args:
      key: the key's two uint32 words (scalars).
      rows: the block's rows' ``(hi, lo)`` words at their first elements (vectors).
      per_row: :func:`row_hash` of ``key``, ``rows`` and ``steps``.
      j: uint32 block-shaped index of each element along its row.
      steps: the counter's ``(hi, lo)`` steps along a row.
      expand: broadcasts a rows' vector to the block (in the kernel's layout).

    Returns:
      uint32 block-shaped bits.
    """
    starts = [expand(w) if step else w for w, step in zip(rows, step_words(steps))]
    return mix(key, None if per_row is None else expand(per_row),
               summed_line(key, starts, j, steps))


def counter_bits(counter: RowCounter, shape: tuple[int, ...], row_axis: int) -> jax.Array:
    """The uint32 random bits of ``(batch, a, b)`` matrices described by ``counter``.

    Args:
      counter: the :class:`RowCounter` of matrices of ``shape``.
      shape: ``(batch, a, b)``.
      row_axis: the axis of the rows (1 or 2).

    Returns:
      ``random_bits(key, hi, lo)`` shaped ``shape``.

    Examples:
      >>> import jax.numpy as jnp
      >>> rows = jnp.zeros((1, 2, 2), jnp.uint32).at[0, 0, 1].set(1)   # rows (0, 0), (1, 0)
      >>> c = RowCounter(jnp.zeros(2, jnp.uint32), rows, (0, 1))       # lo counts along a row
      >>> from pallas_kernels._stochastic_rounding import random_bits
      >>> bool(counter_bits(c, (1, 2, 3), 1)[0, 1, 2]
      ...      == random_bits(jnp.zeros(2, jnp.uint32), jnp.uint32(1), jnp.uint32(2)))
      True
    """
    summed = 3 - row_axis
    j = jax.lax.broadcasted_iota(jnp.uint32, shape, summed)
    # The rows' words stay one per row (a word that does not step is hashed once per row).
    first = [jnp.expand_dims(counter.rows[:, w].astype(jnp.uint32), summed) for w in (0, 1)]
    bits = random_bits(counter_key(counter), *element_words(first, j, counter.steps))
    return jnp.broadcast_to(bits, shape)
