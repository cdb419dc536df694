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
"""The statistics pass as a Pallas kernel through Pallas' Triton lowering (NVIDIA GPUs).

The same op as :func:`pallas_kernels.accumulate_rows`. One program per chunk of a strip of rows
(of columns, when the rows lie along the minor axis): it walks its chunk in blocks, writes ``S``
in place of ``M`` (``input_output_aliases``) and keeps the sums in registers; the chunks'
partial sums are added after the launch. Chunks give one matrix enough programs to keep the
GPU's memory system busy (the step launches once per matrix). jax 0.11 deprecates this lowering,
so :func:`pallas_kernels.accumulate_rows` runs the kernel only when it is named.

Reference: :func:`pallas_kernels._row_stats_reference.accumulate_rows_reference` (``"xla"``);
``tests/test_row_stats.py`` compares this kernel against it in Pallas' interpreter.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _dispatch
from pallas_kernels._common import pow2_divisor
from pallas_kernels._counter import (RowCounter, block_bits, check_counter, counter_key,
                                     row_hash)
from pallas_kernels._row_stats_reference import row_sums, scaled_sum
from pallas_kernels._stochastic_rounding import STOCHASTIC_DTYPES


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RowStatsConfig:
    """The kernel's blocks: the widest powers of two up to these that divide the matrix.

    Attributes:
      strip: rows (columns, for rows along the minor axis) of one program's strip.
      step: the extent along the summed axis walked per loop iteration.
      chunk: the extent along the summed axis of one program (at least ``step``).
      num_warps: warps per program.
    """

    strip: int
    step: int
    chunk: int
    num_warps: int = 4


#: Per row axis: rows along axis 2 (columns of memory) take 64-column strips in chunks of 128
#: rows walked 32 at a time (the fastest of eight on the 7B-shapes groups,
#: ``benchmarks/bench_payload.py``); rows along axis 1 take 8-row strips in chunks of 2048
#: columns walked 512 at a time.
CONFIGS = {2: RowStatsConfig(strip=64, step=32, chunk=128),
           1: RowStatsConfig(strip=8, step=512, chunk=2048)}
#: The narrowest strip (axis 2) or step (axis 1) the kernel takes: 16 float32 columns, 64 bytes.
MIN_MINOR = 16


def _row_part(key_ref, words_ref, steps):
    """The rows' key words, first words and :func:`pallas_kernels._counter.row_hash`, read and
    hashed once per program; None without a counter."""
    if key_ref is None:
        return None
    key, words = (key_ref[0], key_ref[1]), (words_ref[0, :], words_ref[1, :])
    return key, words, row_hash(key, words, steps)


def _bits(rows, j0, block: tuple[int, int], summed: int, steps):
    """The random bits of one block (:func:`pallas_kernels._counter.counter_bits`'s, hashed in
    the program): ``rows`` the :func:`_row_part` of its rows, ``j0`` the block's first index
    along the summed axis; None without a counter."""
    if rows is None:
        return None
    key, words, per_row = rows
    j = jax.lax.broadcasted_iota(jnp.uint32, block, summed) + j0.astype(jnp.uint32)
    return block_bits(key, words, per_row, j, steps,
                      lambda w: jnp.broadcast_to(jnp.expand_dims(w, summed), block))


def _operands(refs, steps, out_scaled: bool):
    """``(key, words, out_scale, s, l1, sq)`` refs from a kernel's trailing ``refs`` (None for
    the operands this call does not have)."""
    refs = list(refs)
    key_ref, words_ref = (None, None) if steps is None else (refs.pop(0), refs.pop(0))
    os_ref = refs.pop(0) if out_scaled else None
    return key_ref, words_ref, os_ref, *refs


def _g(g_ref, at, os_ref):
    """A block of ``G``, times ``S``'s scale where there is one."""
    g = g_ref[at]
    return g if os_ref is None else g.astype(jnp.float32) * os_ref[0]


def _cols_kernel(d_ref, m_ref, g_ref, *refs, step: int, strip: int, steps=None,
                 out_scaled: bool = False):
    """Rows along axis 2: a chunk of a strip of ``strip`` columns (rows of the matrix), walked
    down; with ``steps``, ``refs`` starts with a counter's key and rows' words, then (with
    ``out_scaled``) ``S``'s scale, which multiplies ``d`` and ``G``."""
    key_ref, words_ref, os_ref, s_ref, l1_ref, sq_ref = _operands(refs, steps, out_scaled)
    d, rows = d_ref[...], _row_part(key_ref, words_ref, steps)
    d = d if os_ref is None else d * os_ref[0]
    first = pl.program_id(2) * m_ref.shape[0]

    def body(r, carry):
        at = pl.ds(r * step, step)
        bits = _bits(rows, first + r * step, (step, strip), 0, steps)
        s = scaled_sum(m_ref[at, :], _g(g_ref, (at, slice(None)), os_ref), d[None, :], bits)
        s_ref[at, :] = s
        l1, sq = row_sums(s, 0)
        return carry[0] + l1, carry[1] + sq

    zero = jnp.zeros((strip,), jnp.float32)
    l1_ref[...], sq_ref[...] = jax.lax.fori_loop(0, m_ref.shape[0] // step, body, (zero, zero))


def _rows_kernel(d_ref, m_ref, g_ref, *refs, step: int, strip: int, steps=None,
                 out_scaled: bool = False):
    """Rows along axis 1: a chunk of a strip of ``strip`` rows, walked across; with
    ``steps``, ``refs`` starts with a counter's key and rows' words, then (with ``out_scaled``)
    the gradients' scale."""
    key_ref, words_ref, os_ref, s_ref, l1_ref, sq_ref = _operands(refs, steps, out_scaled)
    d, rows = d_ref[...], _row_part(key_ref, words_ref, steps)
    d = d if os_ref is None else d * os_ref[0]
    first = pl.program_id(2) * m_ref.shape[1]

    def body(c, carry):
        at = pl.ds(c * step, step)
        bits = _bits(rows, first + c * step, (strip, step), 1, steps)
        s = scaled_sum(m_ref[:, at], _g(g_ref, (slice(None), at), os_ref), d[:, None], bits)
        s_ref[:, at] = s
        l1, sq = row_sums(s, 1)
        return carry[0] + l1, carry[1] + sq

    zero = jnp.zeros((strip,), jnp.float32)
    l1_ref[...], sq_ref[...] = jax.lax.fori_loop(0, m_ref.shape[1] // step, body, (zero, zero))


def blocks(shape: tuple[int, int], row_axis: int,
           config: RowStatsConfig | None = None) -> tuple[int, int, int] | None:
    """``(strip, step, chunk)`` for matrices of ``shape``, or None when the minor axis has no
    power-of-two divisor of at least 16 within the configured extent."""
    config = CONFIGS[row_axis] if config is None else config
    strip_axis, sum_axis = (1, 0) if row_axis == 2 else (0, 1)
    strip = pow2_divisor(shape[strip_axis], config.strip)
    step = pow2_divisor(shape[sum_axis], config.step)
    if (strip if row_axis == 2 else step) < MIN_MINOR:
        return None
    return strip, step, max(step, pow2_divisor(shape[sum_axis], config.chunk))


@functools.partial(jax.jit, static_argnames=("row_axis", "interpret", "config"))
def accumulate_rows_triton(m: jax.Array, g: jax.Array, d: jax.Array, *, row_axis: int,
                           interpret: bool = False, config: RowStatsConfig | None = None,
                           counter: RowCounter | None = None, out_scale: jax.Array | None = None
                           ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`pallas_kernels.accumulate_rows` with ``partial_sums=True`` through the
    Pallas-Triton kernel (checked arguments; a shape :func:`blocks` takes; ``config`` default
    :data:`CONFIGS`): the row sums as ``(batch, chunks, n)`` per-chunk sums. ``counter``: for
    a bfloat16 or float16 ``m``, round ``S`` stochastically with the bits it describes, hashed
    in the kernel (:mod:`pallas_kernels._counter`); ignored for other dtypes. ``out_scale``: a
    float32 power of two, ``S = out_scale·(d ⊙ M + G)`` (read once per program)."""
    config = CONFIGS[row_axis] if config is None else config
    b, rows, cols = m.shape
    found = blocks((rows, cols), row_axis, config)
    if found is None:
        raise ValueError(f"the Triton statistics kernel does not take matrices of shape "
                         f"{(rows, cols)} (row_axis={row_axis})")
    strip, step, chunk = found
    n, summed = m.shape[row_axis], m.shape[3 - row_axis]
    if jnp.dtype(m.dtype) not in STOCHASTIC_DTYPES:
        counter = None
    if counter is not None:
        check_counter(counter, b, n)
    if row_axis == 2:
        kernel = _cols_kernel
        whole = pl.BlockSpec((None, chunk, strip), lambda k, j, c: (k, c, j))
    else:
        kernel = _rows_kernel
        whole = pl.BlockSpec((None, strip, chunk), lambda k, i, c: (k, i, c))
    vec = pl.BlockSpec((None, strip), lambda k, i, c: (k, i))
    part = pl.BlockSpec((None, None, strip), lambda k, i, c: (k, c, i))
    partial = jax.ShapeDtypeStruct((b, summed // chunk, n), jnp.float32)
    specs, operands = [vec, whole, whole], [d.astype(jnp.float32), m, g]
    if counter is not None:
        specs += [pl.BlockSpec((2,), lambda k, i, c: (0,)),
                  pl.BlockSpec((None, 2, strip), lambda k, i, c: (k, 0, i))]
        operands += [counter_key(counter), counter.rows.astype(jnp.uint32)]
    if out_scale is not None:
        specs.append(pl.BlockSpec((1,), lambda k, i, c: (0,)))
        operands.append(jnp.reshape(out_scale, (1,)).astype(jnp.float32))
    s, l1, sq = pl.pallas_call(
        functools.partial(kernel, step=step, strip=strip,
                          steps=None if counter is None else counter.steps,
                          out_scaled=out_scale is not None),
        out_shape=(jax.ShapeDtypeStruct(m.shape, m.dtype), partial, partial),
        grid=(b, n // strip, summed // chunk), in_specs=specs,
        out_specs=(whole, part, part), input_output_aliases={1: 0},
        compiler_params=_dispatch.triton_params(config.num_warps, interpret),
        interpret=interpret, name="accumulate_rows",
    )(*operands)
    return s, l1, sq
