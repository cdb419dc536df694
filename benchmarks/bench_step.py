"""Optimizer-step timings on the "7B-shapes" model (DESIGN.md §6), one device.

The model: 8 layers of Llama-7B matrices in Flax (in, out) layout, float32: per layer four
4096×4096 (q, k, v, o), two 4096→11008 (gate, up) and one 11008→4096 (down); 1.62 B matrix
parameters. Each variant is ``jit(update + apply_updates)`` with donated buffers, timed with
``jax.block_until_ready`` after a warm-up; medians of ``--reps`` runs, all variants in one run.

Variants: optax.adamw, optax.contrib.muon, and Dion3 (NorMuon flavour) at f ∈ {1, 1/2, 1/4, 1/8}
× {standard, Gram} Newton-Schulz × every matmul backend available on the device. For Dion3 the
table also gives the time of the batched polar calls alone (same shape groups and selected sizes
as the step) and the rest of the step (selection, gathers, scatters, NorMuon, elementwise).

Usage::

    python benchmarks/bench_step.py                     # the 7B-shapes model (GPU)
    python benchmarks/bench_step.py --small             # a tiny model, CPU smoke run
    python benchmarks/bench_step.py --fractions 1 0.25 --methods gram --backends xla
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

try:
    import dion3_jax
except ImportError:  # running from a source checkout
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import dion3_jax
import pallas_kernels
from _timing import median_ms

FULL = dict(layers=8, d=4096, ff=11008)
SMALL = dict(layers=2, d=64, ff=176)


def model_shapes(layers: int, d: int, ff: int) -> dict[str, tuple[int, int]]:
    shapes = {}
    for i in range(layers):
        for name in ("q", "k", "v", "o"):
            shapes[f"l{i}/{name}"] = (d, d)
        shapes[f"l{i}/gate"] = (d, ff)
        shapes[f"l{i}/up"] = (d, ff)
        shapes[f"l{i}/down"] = (ff, d)
    return shapes


def make_tree(shapes, seed: int, scale: float = 1.0):
    key = jax.random.key(seed)
    out = {}
    for i, (name, s) in enumerate(sorted(shapes.items())):
        out[name] = scale * jax.random.normal(jax.random.fold_in(key, i), s, jnp.float32)
    return out


def time_step(tx, params, grads, reps: int) -> float:
    state = tx.init(params)

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(step, donate_argnums=(0, 1))
    params = jax.tree.map(jnp.copy, params)
    for _ in range(2):  # compile + warm-up
        params, state = jax.block_until_ready(step(params, state, grads))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        params, state = jax.block_until_ready(step(params, state, grads))
        times.append(time.perf_counter() - t0)
    del params, state
    return statistics.median(times) * 1e3


def time_polar(shapes, fraction: float, ortho, reps: int) -> float:
    """The step's polar work alone: one batched call per (wide shape) group of selected rows."""
    groups: dict[tuple[int, int], int] = {}
    for fan_in, fan_out in shapes.values():
        k = dion3_jax.num_selected(fraction, fan_out)
        groups[tuple(sorted((k, fan_in)))] = groups.get(tuple(sorted((k, fan_in))), 0) + 1
    xs = [jax.random.normal(jax.random.key(i), (c, a, b), jnp.float32)
          for i, ((a, b), c) in enumerate(groups.items())]
    fn = jax.jit(lambda xs: [ortho(x) for x in xs])
    return median_ms(fn, xs, reps=reps)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="tiny model (CPU smoke check)")
    p.add_argument("--reps", type=int, default=None, help="timed runs per variant (default 10)")
    p.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.5, 0.25, 0.125])
    p.add_argument("--methods", nargs="+", default=["standard", "gram"],
                   choices=["standard", "gram"])
    p.add_argument("--backends", nargs="+", default=None,
                   help="matmul backends (default: every available one)")
    p.add_argument("--no-baselines", action="store_true", help="skip adamw and optax muon")
    p.add_argument("--no-polar", action="store_true", help="skip the polar-only timings")
    a = p.parse_args(argv)
    cfg = SMALL if a.small else FULL
    reps = a.reps or (3 if a.small else 10)
    backends = a.backends or list(pallas_kernels.available_implementations())
    shapes = model_shapes(**cfg)
    n_params = sum(int(np.prod(s)) for s in shapes.values())
    params = make_tree(shapes, 0)
    grads = make_tree(shapes, 1, 1e-3)
    dev = jax.devices()[0]
    print(f"# device: {dev.device_kind} ({dev.platform}); jax {jax.__version__}; model "
          f"{cfg['layers']} layers d={cfg['d']} ff={cfg['ff']} ({n_params / 1e9:.3f} B matrix "
          f"params, float32); medians of {reps}", flush=True)
    rows = []

    def record(name, ms, polar_ms=None):
        rows.append({"variant": name, "ms": ms, "polar_ms": polar_ms})
        extra = "" if polar_ms is None else f"  (polar {polar_ms:.2f} ms)"
        print(f"  {name}: {ms:.2f} ms{extra}", flush=True)

    if not a.no_baselines:
        record("optax.adamw", time_step(optax.adamw(1e-3), params, grads, reps))
        record("optax.contrib.muon", time_step(optax.contrib.muon(1e-3), params, grads, reps))
    for method in a.methods:
        for backend in backends:
            for f in a.fractions:
                tx = dion3_jax.dion3(0.01, f, method=method, backend=backend)
                ms = time_step(tx, params, grads, reps)
                polar_ms = None
                if not a.no_polar:
                    ortho = dion3_jax.make_orthogonalizer(method=method, backend=backend)
                    polar_ms = time_polar(shapes, f, ortho, reps)
                record(f"dion3 f={f:g} {method} {backend}", ms, polar_ms)

    adamw = next((r["ms"] for r in rows if r["variant"] == "optax.adamw"), None)
    print()
    print("| step | ms (median) | × AdamW | polar ms | rest ms |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        rel = f"{r['ms'] / adamw:.1f}" if adamw else "–"
        pol = f"{r['polar_ms']:.2f}" if r["polar_ms"] is not None else "–"
        rest = f"{r['ms'] - r['polar_ms']:.2f}" if r["polar_ms"] is not None else "–"
        print(f"| {r['variant']} | {r['ms']:.2f} | {rel} | {pol} | {rest} |")
    return rows


if __name__ == "__main__":
    main()
