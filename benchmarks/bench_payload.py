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
"""The statistics and payload passes alone (``pallas_kernels.accumulate_rows``,
``pallas_kernels.stack_payloads``) on the shape groups of the 7B-shapes step, with the payload
kernel's default launch parameters and with variants of them.

Per shape group (its matrices in Flax's ``(in, out)`` layout, the rows selected along the output
axis as the step selects them at ``--fractions``) and per variant (a
``pallas_kernels._payload_triton.PayloadConfig``: the tile and the warps per tile), the table
gives the block shape, the device time of one group's payload pass (``_trace.device_ms``: the
summed GPU op time of a traced call), the wall time (median of ``--reps`` synchronized calls),
the bandwidth by device time, and whether the variant's payload stack is bitwise the default's. The
payload pass reads ``S`` and writes the float16 payloads. Three more rows per group:

- ``XLA, read only``: a sum over ``S`` that XLA runs as one reduction: the rate a read of the
  same bytes reaches on the machine;
- ``statistics kernel``: ``accumulate_rows`` with its momenta donated and carried from call to
  call, as in the step (reads ``M``, ``G``; writes ``S`` in place);
- ``Mosaic statistics kernel``: the same through the Mosaic GPU kernel (where it takes the
  shape);
- ``XLA, statistics``: the same outputs from XLA (the rate of the unfused form);
- at f = 1, ``Mosaic payload kernel`` and ``XLA, payload``: the payload pass of every row
  through the Mosaic GPU kernel (one launch for the group) and through XLA.

One launch per member, as in the step.

Usage::

    python benchmarks/bench_payload.py                      # GPU: every group and variant
    python benchmarks/bench_payload.py --variants b2048 c256 --fractions 0.25 1
    python benchmarks/bench_payload.py --small              # CPU smoke run (interpreted)
    python benchmarks/bench_payload.py --fractions 1 --variants default \
        --mosaic-blocks 32,256,256,3 32,128,512,4           # Mosaic payload block choices
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

try:
    from dion3_jax._selection import num_selected
except ImportError:  # running from a source checkout
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from dion3_jax._selection import num_selected
import pallas_kernels
from pallas_kernels import _payload_mosaic, _payload_triton, _row_stats_mosaic
from pallas_kernels._payload_triton import PayloadConfig
from _timing import median_ms
from _trace import device_ms

VARIANTS = {
    "default": PayloadConfig(),
    "b2048": PayloadConfig(block_elements=2048),
    "b8192": PayloadConfig(block_elements=8192),
    "b8192w8": PayloadConfig(block_elements=8192, num_warps=8),
    "c256": PayloadConfig(max_block_cols=256),
    "c1024": PayloadConfig(max_block_cols=1024),
    "w2": PayloadConfig(num_warps=2),
    "w8": PayloadConfig(num_warps=8),
}
#: (name, matrices, fan_in, fan_out): the 7B-shapes step's groups, 8 layers.
FULL = [("q/k/v/o", 32, 4096, 4096), ("gate/up", 16, 4096, 11008), ("down", 8, 11008, 4096)]
SMALL = [("square", 3, 64, 64), ("wide", 2, 32, 192), ("tall", 2, 96, 64)]


def _momenta(count: int, shape: tuple[int, int]):
    """``count`` matrices, the same values on every call in fresh buffers (they are donated)."""
    key = jax.random.key(0)
    return [jax.random.normal(jax.random.fold_in(key, i), (1, *shape)) for i in range(count)]


def _grads_and_norms(count: int, shape: tuple[int, int]):
    key = jax.random.key(1)
    gs = [1e-3 * jax.random.normal(jax.random.fold_in(key, i), (1, *shape))
          for i in range(count)]
    return gs, 100.0 + jnp.arange(count, dtype=jnp.float32)


def _rows(count: int, n: int, pick: int, seed: int):
    rng = np.random.default_rng(seed)
    return jnp.asarray(np.stack([np.sort(rng.choice(n, pick, replace=False))
                                 for _ in range(count)]), jnp.int32)


def _block(rows: int, cols: int, config: PayloadConfig) -> str:
    return "×".join(map(str, _payload_triton.block_shape(rows, cols, config)))


def _timed(run, *args, reps: int):
    """``(device ms, wall ms)`` of ``run(*args)``."""
    return device_ms(lambda: run(*args), reps=3), median_ms(run, *args, reps=reps)


def _timed_carried(run, count, shape, *extra, reps: int):
    """``(device ms, wall ms)`` of ``run(ms, *extra)``, whose first output is the new momenta:
    they are carried from call to call (donated), as in the step."""
    carried = [_momenta(count, shape)]

    def advance():
        out = run(carried[0], *extra)
        carried[0] = out[0]
        return out

    wall = median_ms(advance, reps=reps)
    return device_ms(advance, reps=3), wall


def time_group(count, shape, pick, config, *, reps: int, interpret: bool):
    """One group's payload pass with ``config``: ``(its stack from the first call, device ms,
    wall ms)``. ``pick`` None: every row (Dion3 at f = 1); else that many output columns per
    matrix."""
    _, ds = _grads_and_norms(count, shape)
    rows = None if pick is None else _rows(count, shape[1], pick, 1)

    def one_pass(ss, ds):  # (the inputs are arguments: as constants they would be embedded
        #                     in the program, gigabytes of it)
        return _payload_triton.stack_payloads_triton(ss, ds, out_dtype=jnp.float16, rows=rows,
                                                     row_axis=2, padded=False,
                                                     interpret=interpret, config=config)

    run, ss = jax.jit(one_pass), _momenta(count, shape)
    return np.asarray(run(ss, ds)), *_timed(run, ss, ds, reps=reps)


def time_read_only(count, shape, *, reps: int):
    """The reference row of the payload pass: XLA reading every ``S`` once (a sum per column):
    ``(device ms, wall ms)``."""
    return _timed(jax.jit(lambda ss: [jnp.sum(s, axis=1) for s in ss]), _momenta(count, shape),
                  reps=reps)


def time_statistics(count, shape, implementation, *, reps: int, interpret: bool):
    """The statistics pass over the group (``accumulate_rows``, one launch per member, the
    momenta donated): ``(device ms, wall ms)``."""
    gs, _ = _grads_and_norms(count, shape)
    ds = [jnp.full((1, shape[1]), 0.9, jnp.float32)] * count

    def one_pass(ms, gs, ds):
        outs = [pallas_kernels.accumulate_rows(m, g, d, row_axis=2,
                                               implementation=implementation,
                                               interpret=interpret)
                for m, g, d in zip(ms, gs, ds)]
        return [o[0] for o in outs], [o[1:] for o in outs]

    return _timed_carried(jax.jit(one_pass, donate_argnums=0), count, shape, gs, ds, reps=reps)


def time_every_row(count, shape, implementation, *, reps: int, interpret: bool):
    """The payload pass over the group with every row selected (``stack_payloads`` without
    ``rows``, as at f = 1) through ``implementation``: ``(device ms, wall ms)``."""
    _, ds = _grads_and_norms(count, shape)

    def one_pass(ss, ds):
        return pallas_kernels.stack_payloads(ss, ds, out_dtype=jnp.float16,
                                             implementation=implementation,
                                             interpret=interpret)

    return _timed(jax.jit(one_pass), _momenta(count, shape), ds, reps=reps)


def time_mosaic_blocks(count, shape, config, *, reps: int, interpret: bool):
    """The Mosaic payload kernel for every row with the blocks ``config``:
    ``(device ms, wall ms)``."""
    _, ds = _grads_and_norms(count, shape)

    def one_pass(ss, ds):
        return _payload_mosaic.stack_payloads_mosaic(ss, ds, out_dtype=jnp.float16,
                                                     config=config, interpret=interpret)

    return _timed(jax.jit(one_pass), _momenta(count, shape), ds, reps=reps)


def _mosaic_block_rows(count, shape, configs, *, reps, interpret):
    """At f = 1, one row per Mosaic payload kernel block choice that takes the shape."""
    size = count * shape[0] * shape[1]
    return [(f"Mosaic payload kernel {c.rows}×{c.cols}, {c.chunk} rows, {c.stages} slots",
             6 * size, time_mosaic_blocks(count, shape, c, reps=reps, interpret=interpret))
            for c in configs if _payload_mosaic.blocks(shape, c) is not None]


def _mosaic_config(text: str) -> _payload_mosaic.MosaicPayloadConfig:
    """``"rows,cols,chunk,stages"`` as a config (for ``--mosaic-blocks``)."""
    rows, cols, chunk, stages = map(int, text.split(","))
    return _payload_mosaic.MosaicPayloadConfig(rows=rows, cols=cols, chunk=chunk, stages=stages)


def _extra_rows(f, first, count, shape, *, reps, interpret):
    """The reference rows of one group: XLA's read of ``S``; the statistics pass by each
    implementation (at the first fraction: it does not depend on f); at f = 1 the payload pass
    through the Mosaic kernel and XLA. Implementations that do not take the shape are left out."""
    size = count * shape[0] * shape[1]
    extra = [("XLA, read only", 4 * size, time_read_only(count, shape, reps=reps))]
    if first:
        for label, impl in (("statistics kernel", "pallas_triton"),
                            ("Mosaic statistics kernel", "mosaic"), ("XLA, statistics", "xla")):
            if impl != "mosaic" or _row_stats_mosaic.blocks(shape, 2) is not None:
                extra.append((label, 12 * size, time_statistics(
                    count, shape, impl, reps=reps, interpret=interpret)))
    if f == 1:
        for label, impl in (("Mosaic payload kernel", "mosaic"), ("XLA, payload", "xla")):
            if impl != "mosaic" or _payload_mosaic.blocks(shape) is not None:
                extra.append((label, 6 * size, time_every_row(
                    count, shape, impl, reps=reps, interpret=interpret)))
    return extra


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="tiny groups, interpreted (CPU smoke)")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.25])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--reps", type=int, default=None, help="synchronized calls (default 10)")
    p.add_argument("--mosaic-blocks", type=_mosaic_config, nargs="+", default=[],
                   metavar="ROWS,COLS,CHUNK,STAGES",
                   help="at f = 1, also time the Mosaic payload kernel with these blocks")
    a = p.parse_args(argv)
    groups, reps = (SMALL, a.reps or 2) if a.small else (FULL, a.reps or 10)
    names = ["default"] + [v for v in a.variants if v != "default"]
    interpret = a.small or jax.default_backend() != "gpu"
    print(f"# {jax.devices()[0].device_kind}; jax {jax.__version__}; "
          f"{'interpreted' if interpret else 'Triton lowering'}", flush=True)
    rows = []
    for f in a.fractions:
        for name, count, fan_in, fan_out in groups:
            pick = None if f == 1 else num_selected(f, fan_out)
            base = None
            for v in names:
                config = VARIANTS[v]
                out, dev, wall = time_group(count, (fan_in, fan_out), pick, config, reps=reps,
                                            interpret=interpret)
                base = out if base is None else base
                same = np.array_equal(out, base)
                moved = count * fan_in * (4 * fan_out + 2 * (pick or fan_out))
                rows.append(dict(f=f, group=name, count=count, shape=(fan_in, fan_out),
                                 pick=pick, variant=v,
                                 block=_block(fan_in, fan_out, config),
                                 warps=config.num_warps, device_ms=dev, wall_ms=wall,
                                 gbps=None if dev is None else moved / dev / 1e6, same=same))
                print(f"  f={f:g} {name} {v}: {wall:.3f} ms wall"
                      + ("" if dev is None else f", {dev:.3f} ms device"), flush=True)
            extra = _extra_rows(f, f == a.fractions[0], count, (fan_in, fan_out), reps=reps,
                                interpret=interpret)
            if f == 1:
                extra += _mosaic_block_rows(count, (fan_in, fan_out), a.mosaic_blocks,
                                            reps=reps, interpret=interpret)
            for label, nbytes, (dev, wall) in extra:
                rows.append(dict(f=f, group=name, count=count, shape=(fan_in, fan_out),
                                 pick=pick, variant=label, block=None, warps=None,
                                 device_ms=dev, wall_ms=wall, same=None,
                                 gbps=None if dev is None else nbytes / dev / 1e6))
                print(f"  f={f:g} {name} {label}: {wall:.3f} ms wall", flush=True)
    print("\n| f | group | matrices | shape | columns picked | variant | block | warps | "
          "device ms | wall ms | GB/s (device) | bitwise = default |")
    print("|---:|---|---:|---|---:|---|---|---:|---:|---:|---:|---|")
    for r in rows:
        dev = "–" if r["device_ms"] is None else f"{r['device_ms']:.3f}"
        gbps = "–" if r["gbps"] is None else f"{r['gbps']:.0f}"
        print(f"| {r['f']:g} | {r['group']} | {r['count']} | {r['shape'][0]}×{r['shape'][1]} | "
              f"{r['pick'] or 'all'} | {r['variant']} | "
              f"{r['block'] or '–'} | "
              f"{r['warps'] or '–'} | {dev} | {r['wall_ms']:.3f} | {gbps} | "
              f"{'–' if r['same'] is None else 'yes' if r['same'] else 'NO'} |")
    return rows


if __name__ == "__main__":
    main()
