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
"""A model of the Mosaic symmetric kernels' time at the optimizer step's shapes, from their schedule.

Not a measurement: it explains measured times, and says what a kernel change could gain. The
Mosaic ``syrk`` and ``sym_matmul`` kernels run one CTA per multiprocessor, each walking work
items (two 128 × 128 output tiles that share a column panel; ``pallas_kernels._schedule``). An
item costs its main loop, ``K / 64`` pipelined steps, plus a fixed epilogue (scaling, ``+ β·c``,
the stores and their mirror), and a CTA's items run one after another, so one product takes::

    time = waves · (K / 64 · step + epilogue),   waves = ceil(batch · items per matrix / SMs)

``waves`` is the most items any CTA walks: the last wave may be nearly empty (``fill`` is the
share of the ``waves × SMs`` item slots that hold work). Two constants, both from one H200 GPU
(``docs/BENCHMARKS.md``, "Kernels"): ``sym_matmul`` 4096² takes 96.3 µs of device time for its
264 items, two per CTA, so 48.15 µs per item at ``K = 4096``; Mosaic's in-kernel profiler puts
11.8% of an item in the epilogue (8.8 of 74.8 µs). Hence ``epilogue`` = 5.67 µs and ``step`` =
(48.15 − 5.67) / 64 = 0.664 µs. The ``hidden`` column is the same product with the epilogue
overlapped by the next item's main loop: the bound of a kernel whose warpgroups take turns.

Per fraction ``f`` of the benchmarks' model (``_model.py``), each shape group's payload
``(k, fan_in)`` is padded as the iteration pads it and run as the default orthogonalizer runs it (Gram or standard
Newton-Schulz, 5 steps, a restart at step 2). Products below ``pallas_kernels.AUTO_MIN_WORK``
run in XLA (``pallas_kernels._api.AUTO_MIN_WORK``) and are listed, not modeled.

Usage::

    python benchmarks/model_kernels.py                   # the 7B-shapes model, f = 1, 1/4, 1/8
    python benchmarks/model_kernels.py --epilogue-us 0   # every epilogue hidden
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import sys
from typing import NamedTuple

try:
    import dion3_jax
except ImportError:  # running from a source checkout
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import dion3_jax
from dion3_jax import _polar
from dion3_jax._selection import num_selected
from pallas_kernels import _api, _schedule
from bench_floor import (FRACTIONS, default_iteration, gram_starts, iteration_method,
                         symmetric_products)
from _model import FULL, SMALL, model_shapes

TILE, TILE_K = _api.TILE_MULTIPLES


class Product(NamedTuple):
    """One kind of symmetric product of a step: ``batch`` matrices ``n × n`` contracted over
    ``k``, called ``calls`` times per step."""

    op: str
    batch: int
    n: int
    k: int
    calls: int


class Timing(NamedTuple):
    items: int
    waves: int
    fill: float
    us: float
    hidden_us: float
    tflops: float


def payload_products(batch: int, rows: int, cols: int, fraction: float) -> list[Product]:
    """The symmetric products of one shape group's polar: ``batch`` payloads of ``k × fan_in``
    (``k`` selected rows of a ``(fan_in, fan_out) = (rows, cols)`` leaf), padded to the kernels'
    tiles."""
    orth, steps = default_iteration()
    k = num_selected(fraction, cols)
    short, long = min(k, rows), max(k, rows)
    n, depth = _polar._padded_shape(short, long, (TILE, TILE_K))
    if iteration_method(orth, k, rows) == "gram":
        return [Product("syrk", batch, n, depth, gram_starts(steps, orth.restarts)),
                Product("sym_matmul", batch, n, n, symmetric_products(steps, orth.restarts))]
    return [Product("syrk", batch, n, depth, steps), Product("sym_matmul", batch, n, n, steps)]


def step_products(shapes: dict[str, tuple[int, int]], fraction: float) -> list[Product]:
    """Every symmetric product of one step, per shape group of same-shape leaves."""
    groups = collections.Counter(shapes.values())
    return [p for (rows, cols), batch in groups.items()
            for p in payload_products(batch, rows, cols, fraction)]


def timing(p: Product, sms: int, step_us: float, epilogue_us: float) -> Timing:
    """The modeled time of one call of ``p`` (module docstring)."""
    items = p.batch * _schedule.num_pair_items(p.n // TILE)
    waves = math.ceil(items / sms)
    loop_us = p.k / TILE_K * step_us
    us = waves * (loop_us + epilogue_us)
    return Timing(items, waves, items / (waves * sms), us, waves * loop_us,
                  p.batch * p.n * (p.n + 1) * p.k / (us * 1e6))


def in_xla(p: Product) -> bool:
    """Whether ``"auto"`` leaves ``p`` to XLA (``pallas_kernels._api.AUTO_MIN_WORK``)."""
    return _api._work((p.batch, p.n, p.k)) < _api.AUTO_MIN_WORK


def table(products: list[Product], sms: int, step_us: float, epilogue_us: float) -> list[str]:
    """One fraction's lines (markdown): a row per product kind, then the per-step sums."""
    lines = ["| product | calls | items | waves | fill | µs per call | TFLOP/s | ms per step "
             "| hidden ms |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    total = collections.Counter()
    for p in products:
        name = f"`{p.op}` {p.batch} × {p.n} × {p.k}"
        if in_xla(p):
            lines.append(f"| {name} | {p.calls} | – | – | – | XLA | – | – | – |")
            continue
        t = timing(p, sms, step_us, epilogue_us)
        total[p.op] += p.calls * t.us / 1e3
        total[p.op + " hidden"] += p.calls * t.hidden_us / 1e3
        lines.append(f"| {name} | {p.calls} | {t.items} | {t.waves} | {t.fill:.2f} | "
                     f"{t.us:.1f} | {t.tflops:.0f} | {p.calls * t.us / 1e3:.2f} | "
                     f"{p.calls * t.hidden_us / 1e3:.2f} |")
    for op in ("syrk", "sym_matmul"):
        lines.append(f"| all `{op}` | | | | | | | {total[op]:.2f} | {total[op + ' hidden']:.2f} |")
    return lines


def main(argv=None) -> list[str]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="tiny model (CPU smoke check)")
    p.add_argument("--fractions", type=float, nargs="+", default=list(FRACTIONS))
    p.add_argument("--sms", type=int, default=132, help="multiprocessors (an H200 has 132)")
    p.add_argument("--step-us", type=float, default=0.664, help="µs per 64-deep step of an item")
    p.add_argument("--epilogue-us", type=float, default=5.67, help="µs per item's epilogue")
    a = p.parse_args(argv)
    cfg = SMALL if a.small else FULL
    shapes = model_shapes(**cfg)
    out = [f"# model: {cfg['layers']} layers d={cfg['d']} ff={cfg['ff']}; {a.sms} SMs, "
           f"{a.step_us} µs per step, {a.epilogue_us} µs per epilogue"]
    for f in a.fractions:
        out += [f"\n## f = {f:g}\n"] + table(step_products(shapes, f), a.sms, a.step_us,
                                              a.epilogue_us)
    print("\n".join(out))
    return out


if __name__ == "__main__":
    main()
