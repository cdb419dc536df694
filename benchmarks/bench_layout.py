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
"""Would the momentum pay for another layout? The step's passes with the momentum in each.

A Flax kernel is ``(in, out)``: the rows Dion3 selects (output neurons) lie along its minor axis,
so gathering a fraction of them reads nearly every 32-byte sector of ``S``. A momentum stored
``(out, in)`` keeps each selected row contiguous, at the price of reading the ``(in, out)``
gradient transposed in the statistics pass and of writing the ``(k, in)`` update transposed into
the parameter. Per fraction, over the 7B-shapes step's leaves (one launch per leaf, as in the
step), the table times:

- ``statistics + gather``: ``S = d ⊙ M + G`` with its row sums (``pallas_kernels.accumulate_rows``,
  the momentum donated and carried from call to call), each leaf's top-k rows by ℓ1 norm and the
  float16 payload gathered from ``S``:
  - ``(in, out), mosaic`` / ``(in, out), xla``: the library's layout, the Mosaic GPU kernel or XLA;
  - ``(out, in), xla``: XLA fuses the transposed read of ``G`` into the pass;
  - ``(out, in), mosaic``: ``G`` transposed by XLA, then the Mosaic GPU kernel;
  - ``(in/8, out, 8), xla``: the momentum "blocked": each 32-byte sector holds 8 input rows of
    one output column, so the gather of selected columns reads whole sectors, and XLA reads
    ``G`` transposed only within 8-row blocks;
- ``parameter pass``: ``W ← 0.999·W − 0.01·U`` with ``U`` the selected rows' update placed from
  ``(in, k)`` (the library) or transposed from ``(k, in)``.

Rows are medians of ``--reps`` interleaved rounds (synchronized wall ms). Before timing, every
variant's payloads on a two-layer model of width 256 are checked against the ``(in, out), xla``
ones.

Usage::

    python benchmarks/bench_layout.py                   # GPU: 8 layers, f = 1/4 and 1/8
    python benchmarks/bench_layout.py --layers 4        # the same on a GPU of 80 GB (8 layers
                                                        # of every variant's arrays do not fit)
    python benchmarks/bench_layout.py --small --reps 1  # CPU smoke run (XLA rows only)
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

try:
    from dion3_jax import _selection
except ImportError:  # running from a source checkout
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from dion3_jax import _selection
import pallas_kernels
from pallas_kernels._row_stats_reference import DOWN
from _timing import median_ms_interleaved
from _model import model_shapes

#: Float32 entries per 32-byte sector: the "blocked" momentum keeps this many input rows of
#: one output column together.
SECTOR = 8

#: (label, momentum layout, statistics implementation). Layouts of a ``(1, in, out)`` leaf's
#: momentum: "in_out" as the leaf; "out_in" transposed; "blocked" ``(1, in / 8, out, 8)``, so
#: that one selected output column reads whole sectors while ``G`` is read transposed only
#: within 8-row blocks.
STATS = (("(in, out), mosaic", "in_out", "mosaic"), ("(in, out), xla", "in_out", "xla"),
         ("(out, in), xla", "out_in", "xla"), ("(out, in), mosaic", "out_in", "mosaic"),
         ("(in/8, out, 8), xla", "blocked", "xla"))


def to_layout(x: jax.Array, layout: str) -> jax.Array:
    """A ``(1, in, out)`` array in ``layout`` (:data:`STATS`)."""
    if layout == "out_in":
        return jnp.swapaxes(x, 1, 2)
    if layout == "blocked":
        _, a, b = x.shape
        return jnp.swapaxes(x.reshape(1, a // SECTOR, SECTOR, b), 2, 3)
    return x


def _inputs(shapes, layout: str, seed: int = 0):
    """Per leaf: momentum in ``layout``, ``(1, in, out)`` gradient and per-row factors."""
    out = []
    for i, (a, b) in enumerate(shapes):
        km, kg = jax.random.split(jax.random.fold_in(jax.random.key(seed), i))
        m = to_layout(jax.random.normal(km, (1, a, b), jnp.float32), layout)
        out.append((m, jax.random.normal(kg, (1, a, b), jnp.float32),
                    jnp.full((1, b), 0.9, jnp.float32)))
    return [list(x) for x in zip(*out)]


def _statistics(m, g, d, layout: str, implementation: str):
    """``(S, ℓ1, sq)``: ``S = d ⊙ M + G`` in ``layout`` and its per-output-row sums, as
    ``pallas_kernels.accumulate_rows`` returns them; the blocked layout's in XLA, with ``G``
    read transposed within 8-row blocks."""
    if layout != "blocked":
        return pallas_kernels.accumulate_rows(m, to_layout(g, layout), d,
                                              row_axis=_row_axis(layout),
                                              implementation=implementation)
    s = pallas_kernels.scaled_sum(m, to_layout(g, layout), d[:, None, :, None])
    return s, jnp.sum(jnp.abs(s), axis=(1, 3)), jnp.sum(jnp.square(s * DOWN), axis=(1, 3))


def _gather(s, idx, layout: str):
    """The selected output rows ``idx`` of ``S`` (stored in ``layout``), ``(1, in, k)`` or
    ``(1, k, in)`` as the library's gather gives them; in the blocked layout each selected
    column is read as whole sectors."""
    if layout != "blocked":
        return _selection.gather_rows(s, idx, _row_axis(layout))
    cols = jnp.swapaxes(jnp.take(s, idx[0], axis=2), 2, 3)  # (1, in / 8, 8, k)
    return cols.reshape(1, -1, idx.shape[1])


def _row_axis(layout: str) -> int:
    return 1 if layout == "out_in" else 2


def _stats_and_gather(fraction: float, layout: str, implementation: str):
    """Jitted ``(M, G, d) → (S, payloads)`` over lists of leaves, ``M`` donated."""
    def one(m, g, d):
        s, l1, sq = _statistics(m, g, d, layout, implementation)
        k = _selection.num_selected(fraction, l1.shape[1])
        idx = jnp.sort(jax.lax.top_k(l1, k)[1], axis=1)
        pay = _gather(s, idx, layout) * jax.lax.rsqrt(jnp.sum(sq) + 1.0)
        return s, pay.astype(jnp.float16)

    return jax.jit(lambda ms, gs, ds: tuple(zip(*map(one, ms, gs, ds))), donate_argnums=(0,))


def _parameter_pass(transposed: bool):
    """Jitted ``(W, rows, sources) → W`` over lists of leaves, ``W`` donated."""
    def one(w, rows, src):
        u = _selection.place_rows(rows, src, 1 if transposed else 2)
        return 0.999 * w - 0.01 * (jnp.swapaxes(u, 1, 2) if transposed else u).astype(w.dtype)

    return jax.jit(lambda ws, rs, ss: [one(*x) for x in zip(ws, rs, ss)], donate_argnums=(0,))


def _parameter_inputs(shapes, fraction: float, transposed: bool):
    ws, rows, srcs = [], [], []
    for i, (a, b) in enumerate(shapes):
        k = _selection.num_selected(fraction, b)
        ws.append(jnp.zeros((1, a, b), jnp.float32))
        rows.append(jnp.ones((1, k, a) if transposed else (1, a, k), jnp.float16))
        idx = jnp.sort(jax.random.permutation(jax.random.key(i), b)[:k])[None]
        srcs.append(_selection.row_sources(_selection.row_positions(idx, b), k))
    return ws, rows, srcs


def _carried(fn, first, *rest):
    """A no-argument call for :func:`median_ms_interleaved` that feeds its donated first
    argument's new value to the next call."""
    box = [first]

    def call():
        out = fn(box[0], *rest)
        box[0] = out[0] if isinstance(out, tuple) else out
        return out
    return call


def check(shapes, fraction: float, variants) -> None:
    """Every variant's payloads equal the ``(in, out), xla`` ones (transposed where stored so)."""
    ms, gs, ds = _inputs(shapes, "in_out")
    _, want = _stats_and_gather(fraction, "in_out", "xla")([m.copy() for m in ms], gs, ds)
    for label, layout, impl in variants:
        _, got = _stats_and_gather(fraction, layout, impl)(  # (M is donated: copies)
            [to_layout(m.copy(), layout) for m in ms], gs, ds)
        for x, y in zip(want, got):
            y = np.swapaxes(np.asarray(y, np.float32), 1, 2) if layout == "out_in" else y
            np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32),
                                       rtol=1e-3, atol=1e-4, err_msg=label)


def table(shapes, fraction: float, variants, reps: int) -> dict[str, float]:
    """Median ms per row (statistics + gather per variant, then the two parameter passes)."""
    calls = {}
    for label, layout, impl in variants:
        ms, gs, ds = _inputs(shapes, layout)
        calls[f"statistics + gather, {label}"] = _carried(
            _stats_and_gather(fraction, layout, impl), ms, gs, ds)
    out = median_ms_interleaved(calls, reps=reps)
    calls = {f"parameter pass, update from {'(k, in)' if t else '(in, k)'}": _carried(
        _parameter_pass(t), *_parameter_inputs(shapes, fraction, t)) for t in (False, True)}
    out.update(median_ms_interleaved(calls, reps=reps))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.125])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--small", action="store_true", help="small leaves (CPU smoke run)")
    a = ap.parse_args(argv)
    d, ff = (256, 512) if a.small else (4096, 11008)
    shapes = list(model_shapes(2 if a.small else a.layers, d, ff).values())
    gpu = jax.default_backend() == "gpu"
    variants = [v for v in STATS if gpu or v[2] == "xla"]
    print(f"{jax.devices()[0].device_kind}; jax {jax.__version__}; {len(shapes)} leaves, "
          f"{sum(a * b for a, b in shapes) / 1e9:.3f} G parameters; median ms of {a.reps} "
          "interleaved rounds")
    for f in a.fractions:
        check(model_shapes(2, 256, 512).values(), f, variants)
        print(f"\nf = {f:g} (payloads checked against (in, out), xla)\n")
        print(f"| {'pass':<46} | {'ms':>8} |\n|---|---:|")
        for name, ms in table(shapes, f, variants, a.reps).items():
            print(f"| {name:<46} | {ms:8.3f} |", flush=True)


if __name__ == "__main__":
    main()
