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
"""Batched collectives: one ``psum`` / ``all_gather`` per distinct set of mesh axes.

The step has many small per-matrix reductions (row norms summed over column shards, NorMuon's
Frobenius terms summed over row shards). Each call here flattens every array that reduces over
the same axes into one buffer, so the number of collectives does not grow with the model's depth.
Mesh axes of size 1 are left out of every collective: there is nothing to reduce over them, and
XLA refuses an all-reduce over a manual axis of size 1 (e.g. one pod's ``"dcn"``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def nontrivial(axes: tuple[str, ...]) -> tuple[str, ...]:
    """``axes`` without those of size 1 (a collective over them changes nothing)."""
    return tuple(a for a in axes if jax.lax.axis_size(a) > 1)


def _by_axes(items) -> dict[tuple, list[int]]:
    groups: dict[tuple, list[int]] = {}
    for i, (_, axes) in enumerate(items):
        groups.setdefault(nontrivial(axes), []).append(i)
    return groups


def batched_psum(items: list[tuple[jax.Array, tuple[str, ...]]]) -> list[jax.Array]:
    """``psum`` of each array over its axes (``()``: unchanged), one collective per axes tuple."""
    out = [x for x, _ in items]
    for axes, idx in _by_axes(items).items():
        if not axes:
            continue
        flat = jax.lax.psum(jnp.concatenate([items[i][0].reshape(-1) for i in idx]), axes)
        off = 0
        for i in idx:
            x = items[i][0]
            out[i] = flat[off:off + x.size].reshape(x.shape)
            off += x.size
    return out


def batched_all_gather(items: list[tuple[jax.Array, tuple[str, ...]]]) -> list[jax.Array]:
    """``all_gather`` of each array over its axes (a new leading device axis), one collective
    per axes tuple."""
    out: dict[int, jax.Array] = {}
    for axes, idx in _by_axes(items).items():
        if not axes:
            for i in idx:
                out[i] = items[i][0][None]
            continue
        flat = jnp.concatenate([items[i][0].reshape(-1) for i in idx])
        g = jax.lax.all_gather(flat, axes, axis=0)            # (W, total)
        off = 0
        for i in idx:
            x = items[i][0]
            out[i] = g[:, off:off + x.size].reshape((g.shape[0], *x.shape))
            off += x.size
    return [out[i] for i in range(len(items))]


def replica_mean(x: jax.Array, axis: str, wire_dtype) -> jax.Array:
    """``pmean`` of a stack of matrices ``(batch, a, b)`` over ``axis``, sent in ``wire_dtype``
    (None: ``x``'s dtype).

    A 16-bit wire first divides each matrix by the largest ``|entry|`` any replica holds of it
    (one float per matrix, a ``pmax``), so every summand lies in [−1, 1] and a sum over fewer
    than 65504 replicas cannot overflow float16; the scale is multiplied back afterwards in
    ``x``'s dtype. A NaN or inf entry makes its matrix NaN (never a silent zero).
    """
    if not nontrivial((axis,)):
        return x
    if wire_dtype is None or jnp.dtype(wire_dtype) == x.dtype:
        return jax.lax.pmean(x, axis)
    amax = jax.lax.pmax(jnp.max(jnp.abs(x), axis=(-2, -1), keepdims=True), axis)
    scale = jnp.where(amax > 0, amax, jnp.ones_like(amax))
    total = jax.lax.psum((x / scale).astype(wire_dtype), axis)
    return total.astype(x.dtype) * (scale / jax.lax.psum(1, axis))
