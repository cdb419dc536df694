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
"""Ways to move selected rows between a Flax-layout matrix and its orthogonalized rows, timed.

The optimizer step gathers the selected rows ``M[I]`` of each matrix, orthogonalizes them as a
``(k, C)`` block (rows leading, as the polar wants a wide matrix) and writes two results back at
the same rows: ``M[I] ← μ·S`` and the update ``U[I] = D``. In Flax's ``(in, out)`` layout the
selected rows are the *minor* axis, and on the H200 the write-back of ``U`` measured 0.52 ms for a
4096×11008 float32 matrix (~350 GB/s). This script times
alternatives on the 7B shapes so that one GPU run can pick the fastest; every variant is checked
against the scatter-based reference first.

Variants of the write-back of ``U`` (``d``: the ``(k, C)`` rows-major result):

- ``scatter``: the first step's form, ``zeros.at[:, idx].set(dᵀ)``;
- ``expand``: the current step's form, ``_selection.expand_rows(dᵀ, pos, row_axis=2)`` (a gather
  along the minor axis of a transposed view);
- ``rowgather_T``: gather whole rows of ``d`` along its leading axis (contiguous), then transpose;
- ``rowgather_barrier_T``: the same with an ``optimization_barrier`` between gather and transpose
  (keeps XLA from fusing the transpose into the gather's strided reads).

And of the payload gather ``S = M[I]`` as a rows-major ``(k, C)`` block: ``take_minor_T`` (the
step's form: gather along the minor axis, then transpose) and ``T_take_rows`` (transpose, then
gather whole rows).

Usage::

    python benchmarks/bench_selection.py              # 7B shapes (GPU)
    python benchmarks/bench_selection.py --small      # CPU smoke run
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _timing import median_ms_rotated, rotated_sets  # noqa: E402
from dion3_jax import _selection  # noqa: E402


def write_back_variants():
    def scatter(d, idx, pos, n):
        zeros = jnp.zeros((1, d.shape[2], n), d.dtype)
        return _selection.scatter_rows(zeros, idx, jnp.swapaxes(d, 1, 2), 2, mode="drop")

    def expand(d, idx, pos, n):
        return _selection.expand_rows(jnp.swapaxes(d, 1, 2), pos, 2)

    def rowgather_t(d, idx, pos, n):
        return jnp.swapaxes(_selection.expand_rows(d, pos, 1), 1, 2)

    def rowgather_barrier_t(d, idx, pos, n):
        return jnp.swapaxes(jax.lax.optimization_barrier(_selection.expand_rows(d, pos, 1)), 1, 2)

    return {"scatter": scatter, "expand": expand, "rowgather_T": rowgather_t,
            "rowgather_barrier_T": rowgather_barrier_t}


def payload_variants():
    def take_minor_t(m, idx):
        return jnp.swapaxes(_selection.gather_rows(m, idx, 2), 1, 2)

    def t_take_rows(m, idx):
        return _selection.gather_rows(jnp.swapaxes(m, 1, 2), idx, 1)

    def sorted_minor_t(m, idx):
        return jnp.swapaxes(_selection.gather_rows(m, jnp.sort(idx, axis=1), 2), 1, 2)

    def barrier_t_rows(m, idx):
        mt = jax.lax.optimization_barrier(jnp.swapaxes(m, 1, 2))
        return _selection.gather_rows(mt, jnp.sort(idx, axis=1), 1)

    return {"take_minor_T": take_minor_t, "T_take_rows": t_take_rows,
            "sorted_minor_T": sorted_minor_t, "barrier_T_sorted_rows": barrier_t_rows}


def fused_payload_variants():
    """``S = (M + G)[I]`` with the momentum sum fused in, as in the step (sorted = ascending
    ``I``: the polar is row-permutation equivariant, so the step may sort)."""
    def fused(m, g, idx):
        return jnp.swapaxes(_selection.gather_rows(m + g, idx, 2), 1, 2)

    def fused_sorted(m, g, idx):
        return jnp.swapaxes(_selection.gather_rows(m + g, jnp.sort(idx, axis=1), 2), 1, 2)

    def barrier_sorted(m, g, idx):
        mg = jax.lax.optimization_barrier(m + g)
        return jnp.swapaxes(_selection.gather_rows(mg, jnp.sort(idx, axis=1), 2), 1, 2)

    def barrier_t_sorted_rows(m, g, idx):
        mt = jax.lax.optimization_barrier(jnp.swapaxes(m + g, 1, 2))
        return _selection.gather_rows(mt, jnp.sort(idx, axis=1), 1)

    return {"fused": fused, "fused_sorted": fused_sorted, "barrier_sorted": barrier_sorted,
            "barrier_T_sorted_rows": barrier_t_sorted_rows}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke check)")
    p.add_argument("--fraction", type=float, default=0.25)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--rotate", type=int, default=4)
    a = p.parse_args(argv)
    # (C, n): Flax (in, out) matrices whose out axis holds the n selectable rows.
    shapes = [(64, 176), (176, 64)] if a.small else [(4096, 11008), (11008, 4096), (4096, 4096)]
    dev = jax.devices()[0]
    print(f"# {dev.device_kind}: f={a.fraction:g}, float32, medians of {a.reps} reps of "
          f"{a.rotate} rotated calls")
    print(f"{'what':<11} {'C x n':<12} {'variant':<22} {'ms':>8} {'GB/s':>8}")
    rng = np.random.default_rng(0)
    for c, n in shapes:
        k = _selection.num_selected(a.fraction, n)
        idx = jnp.asarray(rng.permutation(n)[:k][None], jnp.int32)  # top_k order: unsorted
        pos = _selection.row_positions(idx, n)
        d = jnp.asarray(rng.standard_normal((1, k, c)), jnp.float32)
        m = jnp.asarray(rng.standard_normal((1, c, n)), jnp.float32)
        ref = None
        for name, fn in write_back_variants().items():
            f = jax.jit(lambda d, fn=fn: fn(d, idx, pos, n))
            out = np.asarray(f(d))
            ref = out if ref is None else ref
            np.testing.assert_array_equal(out, ref, err_msg=name)
            ms = median_ms_rotated(f, rotated_sets((d,), a.rotate), reps=a.reps)
            gbs = 4 * (c * n + k * c) / ms / 1e6
            print(f"{'write U':<11} {f'{c}x{n}':<12} {name:<22} {ms:8.3f} {gbs:8.0f}", flush=True)
        ref = None
        for name, fn in payload_variants().items():
            f = jax.jit(lambda m, fn=fn: fn(m, idx))
            out = np.asarray(f(m))
            if "sorted" in name:   # rows in ascending order: compare as sets of rows
                out = out[:, np.argsort(np.argsort(np.asarray(idx)[0]))]
            ref = out if ref is None else ref
            np.testing.assert_array_equal(out, ref, err_msg=name)
            ms = median_ms_rotated(f, rotated_sets((m,), a.rotate), reps=a.reps)
            gbs = 4 * 2 * k * c / ms / 1e6
            print(f"{'gather M[I]':<11} {f'{c}x{n}':<12} {name:<22} {ms:8.3f} {gbs:8.0f}",
                  flush=True)
        g = jnp.asarray(rng.standard_normal((1, c, n)), jnp.float32)
        ref = None
        for name, fn in fused_payload_variants().items():
            f = jax.jit(lambda m, g, fn=fn: fn(m, g, idx))
            out = np.asarray(f(m, g))
            if "sorted" in name:   # rows in ascending order: compare as sets of rows
                out = out[:, np.argsort(np.argsort(np.asarray(idx)[0]))]
            ref = out if ref is None else ref
            np.testing.assert_array_equal(out, ref, err_msg=name)
            ms = median_ms_rotated(f, rotated_sets((m, g), a.rotate), reps=a.reps)
            gbs = 4 * (2 * c * n + k * c) / ms / 1e6
            print(f"{'(M+G)[I]':<11} {f'{c}x{n}':<12} {name:<22} {ms:8.3f} {gbs:8.0f}",
                  flush=True)


if __name__ == "__main__":
    main()
