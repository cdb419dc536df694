"""Compile time of one optimizer step: optax.adamw against Dion3, as the model gets deeper.

The model is ``bench_step.py``'s (per layer four d×d, two d→ff and one ff→d matrices, float32,
Flax layout) with ``--layers`` layers, as abstract ``ShapeDtypeStruct`` leaves: nothing is
allocated, so the 7B shapes run on any machine. Each variant is ``jit(update +
apply_updates)`` with donated params and state, as in ``bench_step.py``; the table gives the
seconds of its three stages, ``jax.jit(...).trace`` (Python), ``.lower`` (StableHLO) and
``.compile`` (XLA), their total and the total as a multiple of AdamW's at the same depth.

Dion3 is ``dion3_jax.dion3`` with its defaults (NorMuon, Gram Newton-Schulz in float16) at each
``--fractions`` value. The XLA compile time depends on the backend (``jax.default_backend()``,
printed first) and on how busy the machine is; run it alone.

Usage::

    python benchmarks/bench_compile.py                         # 8 and 32 layers, f = 1 and 1/4
    python benchmarks/bench_compile.py --layers 8 32 96 --fractions 1 0.25
    python benchmarks/bench_compile.py --layers 2 --d 64 --ff 176   # a small smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import optax

try:
    import dion3_jax
except ImportError:  # running from a source checkout
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import dion3_jax
from bench_step import jitted_step, model_shapes


def compile_seconds(tx: optax.GradientTransformation, params) -> tuple[float, float, float]:
    """Seconds to trace, lower and compile ``jit(update + apply_updates)`` on abstract leaves."""
    state = jax.eval_shape(tx.init, params)
    t0 = time.perf_counter()
    traced = jitted_step(tx).trace(params, state, params)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    lowered.compile()
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.25])
    ap.add_argument("--d", type=int, default=4096, help="model width")
    ap.add_argument("--ff", type=int, default=11008, help="MLP width")
    ap.add_argument("--lr", type=float, default=0.01)
    a = ap.parse_args(argv)
    print(f"backend: {jax.default_backend()}; d={a.d}, ff={a.ff}; seconds")
    print(f"{'layers':>6} {'optimizer':<14} {'trace':>7} {'lower':>7} {'compile':>8} "
          f"{'total':>8} {'× AdamW':>8}")
    for layers in a.layers:
        params = {k: jax.ShapeDtypeStruct(s, jnp.float32)
                  for k, s in model_shapes(layers, a.d, a.ff).items()}
        variants = [("adamw", optax.adamw(a.lr))]
        variants += [(f"dion3 f={f:g}", dion3_jax.dion3(a.lr, f)) for f in a.fractions]
        base = None
        for name, tx in variants:
            tr, lo, co = compile_seconds(tx, params)
            total = tr + lo + co
            base = base or total
            print(f"{layers:>6} {name:<14} {tr:7.2f} {lo:7.2f} {co:8.2f} {total:8.2f} "
                  f"{total / base:8.1f}", flush=True)


if __name__ == "__main__":
    main()
