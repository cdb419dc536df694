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
"""The plain jnp form of the payload pass (:func:`pallas_kernels.stack_payloads`): the selected
rows of each ``S``, divided by their matrix's divisor and cast, stacked.

This is the ``"xla"`` implementation and the reference the kernels
(:mod:`pallas_kernels._payload_triton`, :mod:`pallas_kernels._payload_mosaic`) are tested
against.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def split(x: jax.Array, sizes) -> list[jax.Array]:
    """Consecutive pieces of ``x`` along axis 0, at run-time offsets (behind an optimization
    barrier): XLA would otherwise split the scatter that makes ``x`` into one per piece."""
    offsets = jax.lax.optimization_barrier(
        [np.int32(o) for o in itertools.accumulate(sizes[:-1], initial=0)])
    return [jax.lax.dynamic_slice_in_dim(x, o, n, axis=0, allow_negative_indices=False)
            for o, n in zip(offsets, sizes)]


def _take_rows(s: jax.Array, idx: jax.Array, row_axis: int) -> jax.Array:
    """Rows ``idx`` (``(batch, pick)``, in range) of each matrix of ``s``, along ``row_axis``."""
    dn = jax.lax.GatherDimensionNumbers(
        offset_dims=(3 - row_axis,), collapsed_slice_dims=(row_axis,),
        start_index_map=(row_axis,), operand_batching_dims=(0,), start_indices_batching_dims=(0,))
    sizes = [1, 1, 1]
    sizes[3 - row_axis] = s.shape[3 - row_axis]
    return jax.lax.gather(s, idx[:, :, None], dn, tuple(sizes),
                          mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)


def _select_reference(sums, denoms, rows, row_axis, out_dtype):
    """:func:`stack_payloads_reference` with ``rows``: the gathers per member, the clamp of the
    indices, the padding mask, normalization and cast once on the stack."""
    n = sums[0].shape[row_axis]
    clamped = split(jnp.minimum(rows, n - 1), [x.shape[0] for x in sums])
    stack = jnp.concatenate([_take_rows(s, idx, row_axis) for s, idx in zip(sums, clamped)])
    valid = jnp.expand_dims(rows < n, 3 - row_axis)
    return _normalized(jnp.where(valid, stack, 0), denoms, out_dtype)


def _normalized(stack, denoms, out_dtype):
    return (stack.astype(jnp.float32) / denoms.astype(jnp.float32)[:, None, None]
            ).astype(out_dtype)


def stack_payloads_reference(sums: Sequence[jax.Array], denoms: jax.Array, *, out_dtype,
                             rows: jax.Array | None = None, row_axis: int = 1) -> jax.Array:
    """The plain jnp form of :func:`stack_payloads` (the ``"xla"`` implementation)."""
    if rows is not None:
        return _select_reference(sums, denoms, rows, row_axis, out_dtype)
    return _normalized(jnp.concatenate(sums), denoms, out_dtype)
