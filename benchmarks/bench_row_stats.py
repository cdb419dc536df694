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

Per shape group (float32 momenta and gradients, one launch per member as in the step, the
momenta donated and carried from call to call) and per row axis, each variant's row gives the
device time of the group's pass (``_trace.device_ms``), the bandwidth by device time (12 bytes
per element: ``M`` and ``G`` read, ``S`` written), the ratio to the Triton kernel, and the
largest relative difference of its row sums from the XLA form's (``S`` is checked bitwise).

Variants: ``pallas_triton`` and ``xla`` (the other implementations), ``mosaic`` (the kernel's
``CONFIGS``) and ``mosaic:STRIP,STEP,CHUNK,STAGES`` (any other block configuration, e.g.
``mosaic:64,64,1024,3``).

Usage::

    python benchmarks/bench_row_stats.py                      # GPU: default variants
    python benchmarks/bench_row_stats.py --variants pallas_triton mosaic mosaic:64,64,512,3
    python benchmarks/bench_row_stats.py --small              # CPU smoke run (interpreted)
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
    """The group's pass for ``variant``: ``(ms, gs, ds) -> (new ms, [(l1, sq)])``, or None
    where the variant does not take the shape (decided at trace time by the caller)."""
    impl, config = parse_variant(variant)

    def one(m, g, d):
        if config is not None:  # (the kernel's per-chunk row sums, added up)
            s, l1, sq = _row_stats_mosaic.accumulate_rows_mosaic(
                m, g, d, row_axis=row_axis, config=config, interpret=interpret)
            return s, jnp.sum(l1, axis=1), jnp.sum(sq, axis=1)
        return pallas_kernels.accumulate_rows(m, g, d, row_axis=row_axis, implementation=impl,
                                              interpret=interpret)

    def run(ms, gs, ds):
        outs = [one(m, g, d) for m, g, d in zip(ms, gs, ds)]
        return [o[0] for o in outs], [o[1:] for o in outs]

    return jax.jit(run, donate_argnums=0)


def takes(variant: str, shape, row_axis: int) -> bool:
    impl, config = parse_variant(variant)
    if impl != "mosaic":
        return True
    return _row_stats_mosaic.blocks(shape, row_axis, config) is not None


def _inputs(count, shape, row_axis):
    key = jax.random.key(0)
    ms = [jax.random.normal(jax.random.fold_in(key, i), (1, *shape)) for i in range(count)]
    gs = [1e-3 * jax.random.normal(jax.random.fold_in(key, 100 + i), (1, *shape))
          for i in range(count)]
    ds = [jnp.full((1, shape[row_axis - 1]), 0.9, jnp.float32)] * count
    return ms, gs, ds


def time_variant(variant, count, shape, row_axis, *, reps, interpret):
    """``(device ms or None, first call's S and sums)`` of one variant on one group."""
    run = pass_fn(variant, row_axis, interpret)
    ms, gs, ds = _inputs(count, shape, row_axis)
    out = run(ms, gs, ds)
    first = jax.tree.map(np.asarray, out)
    carried = [out[0]]

    def advance():
        out = run(carried[0], gs, ds)
        carried[0] = out[0]
        return out

    return device_ms(advance, reps=reps), first


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-30)))


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="tiny groups, interpreted (CPU smoke)")
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS)
    p.add_argument("--row-axes", type=int, nargs="+", default=[2, 1], choices=[1, 2])
    p.add_argument("--reps", type=int, default=None, help="traced calls (default 5)")
    a = p.parse_args(argv)
    for v in a.variants:
        parse_variant(v)
    groups, reps = (SMALL, a.reps or 1) if a.small else (FULL, a.reps or 5)
    interpret = a.small or jax.default_backend() != "gpu"
    variants = ["xla"] + [v for v in a.variants if v != "xla"]
    print(f"# {jax.devices()[0].device_kind}; jax {jax.__version__}", flush=True)
    rows = []
    for row_axis in a.row_axes:
        for name, count, *shape in groups:
            ref = base = None
            for v in variants:
                if not takes(v, tuple(shape), row_axis) or (interpret and v == "pallas_triton"):
                    continue
                try:
                    dev, (s, sums) = time_variant(v, count, shape, row_axis, reps=reps,
                                                  interpret=interpret)
                except ValueError as e:  # e.g. blocks past the shared memory
                    print(f"  axis {row_axis} {name} {v}: does not compile: {e}", flush=True)
                    continue
                ref = (s, sums) if ref is None else ref
                base = dev if v == "pallas_triton" else base
                rows.append(dict(row_axis=row_axis, group=name, count=count, shape=shape,
                                 variant=v, device_ms=dev,
                                 s_same=all(np.array_equal(x, y) for x, y in zip(s, ref[0])),
                                 rel=max(_rel(x, y) for xs, ys in zip(sums, ref[1])
                                         for x, y in zip(xs, ys))))
                print(f"  axis {row_axis} {name} {v}: "
                      + ("–" if dev is None else f"{dev:.3f} ms"), flush=True)
            for r in rows:
                if r["group"] == name and r["row_axis"] == row_axis:
                    r["vs_pallas_triton"] = (None if base is None or r["device_ms"] is None
                                             else r["device_ms"] / base)
    print("\n| row axis | group | matrices | shape | variant | device ms | GB/s | "
          "÷ pallas_triton | S bitwise = XLA | sums: max rel. diff from XLA |")
    print("|---:|---|---:|---|---|---:|---:|---:|---|---:|")
    for r in rows:
        dev, ratio = r["device_ms"], r.get("vs_pallas_triton")
        size = r["count"] * r["shape"][0] * r["shape"][1]
        print(f"| {r['row_axis']} | {r['group']} | {r['count']} | "
              f"{r['shape'][0]}×{r['shape'][1]} | {r['variant']} | "
              f"{'–' if dev is None else f'{dev:.3f}'} | "
              f"{'–' if dev is None else f'{12 * size / dev / 1e6:.0f}'} | "
              f"{'–' if ratio is None else f'{ratio:.3f}'} | "
              f"{'yes' if r['s_same'] else 'NO'} | {r['rel']:.1e} |")
    return rows


if __name__ == "__main__":
    main()
