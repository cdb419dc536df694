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
"""The statistics pass on Hopper with Pallas Mosaic GPU (``plgpu.kernel``).

The same op as :func:`pallas_kernels.accumulate_rows`: ``S = d ⊙ M + G`` written in place of
``M``, with each row's ℓ1 norm and scaled sum of squares, from one read of ``M`` and ``G``.

One CTA (one warpgroup) per chunk of a strip of rows. It walks its chunk in blocks along the
summed axis through a ring of ``stages`` shared-memory slots: TMA brings the ``M`` and ``G``
blocks in (one barrier each per slot), the warpgroup loads them in the ``WGMMA`` register layout,
computes ``S`` in float32, stores it to its slot of the ``S`` ring, and TMA writes it back over
``M``'s block (the momentum's buffer is passed as a mutable ``jax.Ref``, so the kernel writes
``S`` in place and the step moves no second copy). ``|S|`` and ``(S·2⁻³²)²`` are added up
elementwise in two block-shaped float32 accumulators in registers; only after the walk does the
CTA reduce them along the summed axis (so the loop has no cross-lane or cross-warp reduction),
and each chunk's partial sums go to a small float32 array that XLA adds up after the launch.

A bfloat16 or float16 momentum with a :class:`pallas_kernels._counter.RowCounter` is rounded
stochastically: the CTA brings its rows' counter words in beside ``d`` (8 bytes a row), hashes
the word that is fixed along a row once per row and the other, formed from an iota, per block
element, in registers (:func:`pallas_kernels._counter.block_bits`, the counter hash of
:mod:`pallas_kernels._counter_hash`), so the momentum still moves 2 bytes each way per element;
``S`` is then the reference's bit for bit. Where the stepping word starts at the same value on
every row (the counter's ``common_start``, as on a 2-D leaf), its line hash depends only on the
index along the summed axis: the CTA hashes it on a vector once per block and broadcasts it,
leaving the final mix as the only hash per element.

Reference: :func:`pallas_kernels._row_stats_reference.accumulate_rows_reference`, the plain jnp
form (``"xla"``); ``tests/test_row_stats_mosaic.py`` and ``tests/test_row_stats_stochastic.py``
compare this kernel against it in GPU interpret mode on the CPU and ``tests/test_kernels_gpu.py``
on a Hopper GPU.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np

from pallas_kernels._common import TMA_MIN_MINOR, mosaic_interpret_params, pow2_divisor
from pallas_kernels._counter import (RowCounter, block_bits, check_counter, key_table, mix,
                                     row_hash, summed_line)
from pallas_kernels._row_stats_reference import DOWN, scaled_sum
from pallas_kernels._stochastic_rounding import STOCHASTIC_DTYPES

#: Rows of the ``WGMMA`` register layout: a block's extent along axis 1 is a multiple of it.
_LAYOUT_ROWS = 64


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MosaicRowStatsConfig:
    """The kernel's blocks: the widest powers of two up to these that divide the matrix.

    Attributes:
      strip: rows of one CTA's strip (along the minor axis for rows along axis 2; exactly 64,
        the layout's rows, for rows along axis 1).
      step: the extent along the summed axis of one block (exactly 64 for rows along axis 2).
      chunk: the extent along the summed axis of one CTA (at least ``step``).
      stages: shared-memory slots of the ring.
    """

    strip: int
    step: int
    chunk: int
    stages: int


#: Per row axis, the fastest of the blocks timed on the 7B-shapes matrices (one H200):
#: 64 × 64 blocks, 256 (axis 2) or 512 (axis 1) along the summed axis per CTA.
CONFIGS = {2: MosaicRowStatsConfig(strip=64, step=_LAYOUT_ROWS, chunk=256, stages=2),
           1: MosaicRowStatsConfig(strip=_LAYOUT_ROWS, step=64, chunk=512, stages=3)}


def blocks(shape: tuple[int, int], row_axis: int,
           config: MosaicRowStatsConfig | None = None) -> tuple[int, int, int] | None:
    """``(strip, step, chunk)`` for matrices of ``shape``, or None when the kernel does not take
    it (an extent along axis 1 that is not a multiple of 64, or a minor axis without a
    power-of-two divisor of at least 16 within the configured extent)."""
    config = CONFIGS[row_axis] if config is None else config
    rows, cols = shape
    if rows % _LAYOUT_ROWS:
        return None
    if row_axis == 2:
        strip, step, summed = pow2_divisor(cols, config.strip), _LAYOUT_ROWS, rows
        minor = strip
    else:
        strip, step, summed = _LAYOUT_ROWS, pow2_divisor(cols, config.step), cols
        minor = step
    if minor < TMA_MIN_MINOR:
        return None
    return strip, step, max(step, pow2_divisor(summed, config.chunk))


def _block_bits(key, words, per_row, j0, block: tuple[int, int], summed: int,
                steps: tuple[int, int], start=None) -> jax.Array:
    """The random bits of one block (:func:`pallas_kernels._counter.counter_bits`'s, hashed in
    registers): ``words`` its rows' ``(hi, lo)`` at their first elements, ``per_row`` their
    :func:`pallas_kernels._counter.row_hash`, ``j0`` the block's first index along the summed
    axis. With ``start`` (the matrix's ``(hi, lo)`` scalars at a row's first element, for a
    counter with ``common_start``) the stepping words are hashed once per index along the
    summed axis, on a vector, and broadcast over the rows."""
    wgmma = plgpu.Layout.WGMMA
    j0 = lax.convert_element_type(j0, jnp.uint32)
    if start is None:
        j = plgpu.layout_cast(lax.broadcasted_iota(jnp.uint32, block, summed), wgmma)
        return block_bits(key, words, per_row, j + j0, steps,
                          lambda w: lax.broadcast_in_dim(w, block, (1 - summed,)))
    j = plgpu.broadcasted_iota(jnp.uint32, (block[summed],), 0,
                               layout=wgmma.reduce(1 - summed))
    line = summed_line(key, start, j + j0, steps)
    bits = mix(key, None if per_row is None else lax.broadcast_in_dim(per_row, block,
                                                                       (1 - summed,)),
               None if line is None else lax.broadcast_in_dim(line, block, (summed,)))
    return jnp.broadcast_to(bits, block)


def _body(d_gmem, m_gmem, g_gmem, *refs, row_axis: int, strip: int, step: int, steps: int,
          stages: int, counter_steps: tuple[int, int] | None, common_start: bool,
          out_scaled: bool):
    """One CTA: chunk ``c`` of strip ``i`` of matrix ``k``; with ``counter_steps``, ``refs``
    starts with the counter's key table, its row (:func:`pallas_kernels._counter.key_table`)
    and its rows' words, its scratch ends with a slot for the rows' words, and ``S`` is
    rounded stochastically with bits hashed here (``common_start``: the counter's, read off
    the strip's first row); with ``out_scaled`` the
    next input is ``S``'s float32 scale (one element), read once, which multiplies ``d`` and
    ``G``."""
    stochastic = counter_steps is not None
    rest = list(refs)
    key_gmem: Any = rest.pop(0) if stochastic else None
    index_gmem: Any = rest.pop(0) if stochastic else None
    words_gmem: Any = rest.pop(0) if stochastic else None
    out = rest.pop(0)[0] if out_scaled else None
    w_smem: Any = None
    if stochastic:
        l1_gmem, sq_gmem, m_smem, g_smem, s_smem, v_smem, w_smem, m_bar, g_bar = rest
    else:
        l1_gmem, sq_gmem, m_smem, g_smem, s_smem, v_smem, m_bar, g_bar = rest
    k, i, c = lax.axis_index("k"), lax.axis_index("i"), lax.axis_index("c")
    rows = pl.ds(i * strip, strip)
    summed = 1 if row_axis == 1 else 0              # the block's summed axis
    block = (strip, step) if row_axis == 1 else (step, strip)
    wgmma = plgpu.Layout.WGMMA
    vector = wgmma.reduce(summed)

    def at(t):
        walked = pl.ds((c * steps + t) * step, step)
        return (k, rows, walked) if row_axis == 1 else (k, walked, rows)

    def fetch(t, slot):
        plgpu.copy_gmem_to_smem(m_gmem.at[at(t)], m_smem.at[slot], m_bar.at[slot])
        plgpu.copy_gmem_to_smem(g_gmem.at[at(t)], g_smem.at[slot], g_bar.at[slot])

    plgpu.copy_gmem_to_smem(d_gmem.at[k, rows], v_smem.at[0], m_bar.at[stages])
    if stochastic:
        plgpu.copy_gmem_to_smem(words_gmem.at[k, :, rows], w_smem, m_bar.at[stages + 1])
    for t in range(min(stages, steps)):
        fetch(t, t)
    plgpu.barrier_wait(m_bar.at[stages])
    d = plgpu.load(v_smem.at[0], layout=vector, optimized=False)
    d = lax.broadcast_in_dim(d if out is None else d * out, block, (1 - summed,))
    if counter_steps is not None:
        plgpu.barrier_wait(m_bar.at[stages + 1])
        row = index_gmem[0]
        key = (key_gmem[row, 0], key_gmem[row, 1])
        words = [plgpu.load(w_smem.at[w], layout=vector, optimized=False) for w in (0, 1)]
        per_row = row_hash(key, words, counter_steps)        # once, before the walk
        start = ((words_gmem[k, 0, i * strip], words_gmem[k, 1, i * strip]) if common_start
                 else None)

    def walk(t, sums):
        slot = lax.rem(t, stages)
        plgpu.barrier_wait(m_bar.at[slot])
        plgpu.barrier_wait(g_bar.at[slot])
        bits = (None if not stochastic else
                _block_bits(key, words, per_row, (c * steps + t) * step, block, summed,
                            counter_steps, start))
        g = plgpu.load(g_smem.at[slot], layout=wgmma)
        if out is not None:
            g = g.astype(jnp.float32) * out
        s = scaled_sum(plgpu.load(m_smem.at[slot], layout=wgmma), g, d, bits)
        plgpu.wait_smem_to_gmem(stages - 1, wait_read_only=True)  # this S slot's last store
        s_smem[slot] = s
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(s_smem.at[slot], m_gmem.at[at(t)])

        @pl.when(t + stages < steps)
        def _():
            fetch(t + stages, slot)

        x = s.astype(jnp.float32)
        return sums[0] + jnp.abs(x), sums[1] + lax.square(x * np.float32(DOWN))

    zero = plgpu.layout_cast(jnp.zeros(block, jnp.float32), wgmma)
    l1, sq = lax.fori_loop(0, steps, walk, (zero, zero))
    l1, sq = jnp.sum(l1, axis=summed), jnp.sum(sq, axis=summed)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    v_smem[0], v_smem[1] = l1, sq
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(v_smem.at[0], l1_gmem.at[k, c, rows])
    plgpu.copy_smem_to_gmem(v_smem.at[1], sq_gmem.at[k, c, rows])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("row_axis", "config", "interpret"))
def accumulate_rows_mosaic(m: jax.Array, g: jax.Array, scale: jax.Array, *, row_axis: int,
                           config: MosaicRowStatsConfig | None = None, interpret: bool = False,
                           counter: RowCounter | None = None, out_scale: jax.Array | None = None
                           ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`pallas_kernels.accumulate_rows` through the Mosaic GPU kernel (checked
    arguments; a shape :func:`blocks` takes).

    Args:
      m: momenta ``(batch, a, b)``; ``S`` is written into its buffer when it is donated.
      g: gradients shaped like ``m``.
      scale: ``(batch, n)`` per-row factors ``d`` (``n = m.shape[row_axis]``).
      row_axis: the axis of the rows (1 or 2).
      config: the blocks (default :data:`CONFIGS` for the row axis).
      interpret: run through GPU interpret mode (CPU; slow; for tests).
      counter: for a bfloat16 or float16 ``m``, round ``S`` stochastically with the bits this
        :class:`pallas_kernels._counter.RowCounter` describes, hashed in the kernel (each
        CTA reads its rows' words, 8 bytes a row); ignored for other dtypes.
      out_scale: a float32 scalar, a power of two: ``S = out_scale·(d ⊙ M + G)`` (each CTA
        reads it once and multiplies ``d`` and the gradients by it).

    Returns:
      ``(S, l1, sq)`` as :func:`pallas_kernels.accumulate_rows` returns them with
      ``partial_sums=True``: the row sums as ``(batch, chunks, n)`` per-chunk sums.
    """
    config = CONFIGS[row_axis] if config is None else config
    found = blocks((m.shape[1], m.shape[2]), row_axis, config)
    if found is None:
        raise ValueError(f"the Mosaic statistics kernel does not take matrices of shape "
                         f"{m.shape[1:]} (row_axis={row_axis})")
    strip, step, chunk = found
    batch, n, summed = m.shape[0], m.shape[row_axis], m.shape[3 - row_axis]
    block = (strip, step) if row_axis == 1 else (step, strip)
    stages = min(config.stages, chunk // step)
    if jnp.dtype(m.dtype) not in STOCHASTIC_DTYPES:
        counter = None
    if counter is not None:
        check_counter(counter, batch, n)
    partial = jax.ShapeDtypeStruct((batch, summed // chunk, n), jnp.float32)
    kernel = plgpu.kernel(
        functools.partial(_body, row_axis=row_axis, strip=strip, step=step,
                          steps=chunk // step, stages=stages,
                          counter_steps=None if counter is None else counter.steps,
                          common_start=counter is not None and counter.common_start,
                          out_scaled=out_scale is not None),
        out_type=(partial, partial),
        scratch_types=[plgpu.SMEM((stages, *block), m.dtype),
                       plgpu.SMEM((stages, *block), g.dtype),
                       plgpu.SMEM((stages, *block), m.dtype),
                       plgpu.SMEM((2, strip), jnp.float32),
                       *([] if counter is None else [plgpu.SMEM((2, strip), jnp.uint32)]),
                       plgpu.Barrier(num_barriers=stages + 2),
                       plgpu.Barrier(num_barriers=stages)],
        grid=(batch, n // strip, summed // chunk), grid_names=("k", "i", "c"),
        interpret=mosaic_interpret_params(interpret), kernel_name="accumulate_rows")
    s = jax.new_ref(m)
    words = (() if counter is None else
             (*key_table(counter), counter.rows.astype(jnp.uint32)))
    scaled = () if out_scale is None else (jnp.reshape(out_scale, (1,)).astype(jnp.float32),)
    l1, sq = kernel(scale.astype(jnp.float32), s, g, *words, *scaled)
    return s[...], l1, sq
