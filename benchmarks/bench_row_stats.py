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
"""The statistics pass (``pallas_kernels.accumulate_rows``) alone, per implementation and per
block configuration of the Mosaic GPU kernel, on the shape groups of the 7B-shapes step.

Per shape group (float32 gradients; float32 momenta unless ``--momentum-dtypes`` names others;
one launch per member as in the step, the momenta donated and carried from call to call) and
per row axis, each variant's row gives the device time of the group's pass
(``_trace.device_ms``), the bandwidth by device time (``M`` read and ``S`` written in the
momentum's dtype, ``G`` read: 12 bytes per element for float32 momenta, 8 for 16-bit ones), the
ratios to the Triton kernel and to XLA, and the largest relative difference of its row sums
from the XLA form's (``S`` is checked bitwise).

A bfloat16 or float16 momentum is rounded stochastically, as the step rounds it: XLA computes
the counter hash (``pallas_kernels/_counter_hash.py``) of each element's counter words, the
Mosaic kernel hashes them itself from a ``RowCounter`` (``pallas_kernels/_counter.py``; the
rows' words of the step's 2-D leaves), and so does the Pallas-Triton kernel.

Variants: ``pallas_triton`` and ``xla`` (the other implementations), ``mosaic`` (the kernel's
``CONFIGS``) and ``mosaic:STRIP,STEP,CHUNK,STAGES`` (any other block configuration, e.g.
``mosaic:64,64,1024,3``).

Usage::

    python benchmarks/bench_row_stats.py                      # GPU: default variants
    python benchmarks/bench_row_stats.py --variants pallas_triton mosaic mosaic:64,64,512,3
    python benchmarks/bench_row_stats.py --small              # CPU smoke run (interpreted)
    python benchmarks/bench_row_stats.py --variants xla mosaic --momentum-dtypes float32 bfloat16
    python benchmarks/bench_row_stats.py --variants xla mosaic --momentum-dtypes float16 \
        --per-row-starts           # the stepping word hashed per vector and per element
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

try:
    import pallas_kernels
except ImportError:  # running from a source checkout
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import pallas_kernels
from pallas_kernels import _row_stats_mosaic
from pallas_kernels._counter import RowCounter
from pallas_kernels._row_stats_mosaic import MosaicRowStatsConfig
from _trace import device_ms
from bench_payload import FULL  # (name, matrices, a, b): the 7B-shapes step's groups

SMALL = [("square", 2, 128, 128), ("wide", 1, 64, 256)]
DEFAULT_VARIANTS = ["pallas_triton", "xla", "mosaic", "mosaic:64,64,512,2", "mosaic:64,64,1024,3",
                    "mosaic:64,128,512,3", "mosaic:128,64,256,2"]


def parse_variant(name: str):
    """``(implementation, Mosaic config or None)`` of a variant's name."""
    if name in ("pallas_triton", "xla", "mosaic"):
        return name, None
    if not name.startswith("mosaic:"):
        raise ValueError(f"unknown variant {name!r}")
    strip, step, chunk, stages = (int(x) for x in name.split(":", 1)[1].split(","))
    return "mosaic", MosaicRowStatsConfig(strip=strip, step=step, chunk=chunk, stages=stages)


def pass_fn(variant: str, row_axis: int, interpret: bool):
    """The group's pass for ``variant``: ``(ms, gs, ds, counters) -> (new ms, [(l1, sq)])``
    (``counters``: per member a ``RowCounter``, or None for round-to-nearest)."""
    impl, config = parse_variant(variant)

    def one(m, g, d, counter):
        if config is not None:  # (the kernel's per-chunk row sums, added up)
            s, l1, sq = _row_stats_mosaic.accumulate_rows_mosaic(
                m, g, d, row_axis=row_axis, config=config, interpret=interpret,
                counter=counter)
            return s, jnp.sum(l1, axis=1), jnp.sum(sq, axis=1)
        return pallas_kernels.accumulate_rows(m, g, d, row_axis=row_axis, implementation=impl,
                                              interpret=interpret, counter=counter)

    def run(ms, gs, ds, counters):
        outs = [one(m, g, d, c) for m, g, d, c in zip(ms, gs, ds, counters)]
        return [o[0] for o in outs], [o[1:] for o in outs]

    return jax.jit(run, donate_argnums=0)


def takes(variant: str, shape, row_axis: int) -> bool:
    impl, config = parse_variant(variant)
    if impl != "mosaic":
        return True
    return _row_stats_mosaic.blocks(shape, row_axis, config) is not None


def _counter(i: int, shape, row_axis: int, common_start: bool = True) -> RowCounter:
    """A 2-D leaf's counter (``dion3_jax._rounding.block_counters``' form): a row's ``hi`` word
    is its index along axis 1, its ``lo`` word its index along axis 2; the summed axis steps
    the other one, which starts at 0 on every row (``common_start``, as the step promises it;
    False times the kernel that hashes the stepping word per element)."""
    key = jax.random.key_data(jax.random.key(1000 + i, impl="threefry2x32"))
    n = shape[row_axis - 1]
    rows = jnp.zeros((1, 2, n), jnp.uint32).at[0, row_axis - 1].set(jnp.arange(n,
                                                                                dtype=jnp.uint32))
    return RowCounter(key, rows, (0, 1) if row_axis == 1 else (1, 0),
                      common_start=common_start)


def _inputs(count, shape, row_axis, dtype=jnp.float32, common_start=True):
    key = jax.random.key(0)
    ms = [jax.random.normal(jax.random.fold_in(key, i), (1, *shape)).astype(dtype)
          for i in range(count)]
    gs = [1e-3 * jax.random.normal(jax.random.fold_in(key, 100 + i), (1, *shape))
          for i in range(count)]
    ds = [jnp.full((1, shape[row_axis - 1]), 0.9, jnp.float32)] * count
    counters = ([None] * count if jnp.dtype(dtype) == jnp.float32
                else [_counter(i, shape, row_axis, common_start) for i in range(count)])
    return ms, gs, ds, counters


def time_variant(variant, count, shape, row_axis, *, reps, interpret, dtype=jnp.float32,
                 common_start=True):
    """``(device ms or None, first call's S and sums)`` of one variant on one group."""
    run = pass_fn(variant, row_axis, interpret)
    ms, gs, ds, counters = _inputs(count, shape, row_axis, dtype, common_start)
    out = run(ms, gs, ds, counters)
    first = jax.tree.map(np.asarray, out)
    carried = [out[0]]

    def advance():
        out = run(carried[0], gs, ds, counters)
        carried[0] = out[0]
        return out

    return device_ms(advance, reps=reps), first


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-30)))


def measure(groups, variants, row_axes, dtypes, *, reps, interpret,
            per_row_starts=False) -> list[dict]:
    """One row per (row axis, group, momentum dtype, variant) that takes it; XLA first. With
    ``per_row_starts`` a 16-bit momentum's Mosaic rows are timed again with counters that do
    not promise a common start (variant ``mosaic per-row``)."""
    rows = []
    for row_axis in row_axes:
        for name, count, *shape in groups:
            for dtype in dtypes:
                ref = None
                both = per_row_starts and jnp.dtype(dtype).itemsize == 2
                for v, common in [(v, True) for v in variants] + [
                        (v, False) for v in variants if both and v.startswith("mosaic")]:
                    if not takes(v, tuple(shape), row_axis) or (interpret
                                                                 and v == "pallas_triton"):
                        continue
                    v_name = v if common else f"{v} per-row"
                    label = f"axis {row_axis} {name} {jnp.dtype(dtype).name} {v_name}"
                    try:
                        dev, (s, sums) = time_variant(v, count, shape, row_axis, reps=reps,
                                                      interpret=interpret, dtype=dtype,
                                                      common_start=common)
                    except ValueError as e:  # e.g. blocks past the shared memory
                        print(f"  {label}: does not compile: {e}", flush=True)
                        continue
                    ref = (s, sums) if ref is None else ref
                    rows.append(dict(row_axis=row_axis, group=name, count=count, shape=shape,
                                     dtype=jnp.dtype(dtype).name, variant=v_name,
                                     device_ms=dev,
                                     s_same=all(np.array_equal(x, y)
                                                for x, y in zip(s, ref[0])),
                                     rel=max(_rel(x, y) for xs, ys in zip(sums, ref[1])
                                             for x, y in zip(xs, ys))))
                    print(f"  {label}: " + ("–" if dev is None else f"{dev:.3f} ms"),
                          flush=True)
    return rows


def _ratio(r, rows, variant) -> str:
    """``r``'s device time over ``variant``'s on the same group, row axis and dtype."""
    base = next((b["device_ms"] for b in rows if b["variant"] == variant and all(
        b[k] == r[k] for k in ("row_axis", "group", "dtype"))), None)
    return "–" if base is None or r["device_ms"] is None else f"{r['device_ms'] / base:.3f}"


def print_table(rows) -> None:
    print("\n| row axis | group | matrices | shape | momentum | variant | device ms | GB/s | "
          "÷ pallas_triton | ÷ xla | S bitwise = XLA | sums: max rel. diff from XLA |")
    print("|---:|---|---:|---|---|---|---:|---:|---:|---:|---|---:|")
    for r in rows:
        dev = r["device_ms"]
        size = r["count"] * r["shape"][0] * r["shape"][1]
        nbytes = 2 * jnp.dtype(r["dtype"]).itemsize + 4     # M read, S written, G read
        print(f"| {r['row_axis']} | {r['group']} | {r['count']} | "
              f"{r['shape'][0]}×{r['shape'][1]} | {r['dtype']} | {r['variant']} | "
              f"{'–' if dev is None else f'{dev:.3f}'} | "
              f"{'–' if dev is None else f'{nbytes * size / dev / 1e6:.0f}'} | "
              f"{_ratio(r, rows, 'pallas_triton')} | {_ratio(r, rows, 'xla')} | "
              f"{'yes' if r['s_same'] else 'NO'} | {r['rel']:.1e} |")


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="tiny groups, interpreted (CPU smoke)")
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS)
    p.add_argument("--row-axes", type=int, nargs="+", default=[2, 1], choices=[1, 2])
    p.add_argument("--momentum-dtypes", nargs="+", default=["float32"],
                   choices=["float32", "bfloat16", "float16"],
                   help="momentum dtypes (16-bit ones rounded stochastically)")
    p.add_argument("--per-row-starts", action="store_true",
                   help="also time each 16-bit Mosaic row with counters that do not promise a "
                        "common start (the stepping word hashed per element)")
    p.add_argument("--reps", type=int, default=None, help="traced calls (default 5)")
    a = p.parse_args(argv)
    for v in a.variants:
        parse_variant(v)
    groups, reps = (SMALL, a.reps or 1) if a.small else (FULL, a.reps or 5)
    interpret = a.small or jax.default_backend() != "gpu"
    variants = ["xla"] + [v for v in a.variants if v != "xla"]
    print(f"# {jax.devices()[0].device_kind}; jax {jax.__version__}", flush=True)
    rows = measure(groups, variants, a.row_axes, [jnp.dtype(d) for d in a.momentum_dtypes],
                   reps=reps, interpret=interpret, per_row_starts=a.per_row_starts)
    print_table(rows)
    return rows


if __name__ == "__main__":
    main()
