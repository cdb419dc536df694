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
"""Polar-operator timings: XLA standard NS, XLA Gram NS (and kernel backends), optax's NS.

Prints a table: shape, method, backend, compute dtype, ms (median wall time of synchronized
calls), device ms (the GPU ops' own time in a profiler trace: ``_trace.device_ms``; "-" on a CPU),
TFLOP/s (of the wall time; useful FLOPs of standard NS with symmetric products counted once, so
methods compare on one scale), relative error against a float32 standard-NS run with the same
coefficients.

Usage:
  python benchmarks/bench_polar.py                  # the 7B model's polar shapes (GPU)
  python benchmarks/bench_polar.py --small          # tiny shapes, a CPU smoke run
  python benchmarks/bench_polar.py --shapes step --variants gram:float16 standard:float16
      # the payload stacks of the 7B-shapes step at f = 1, 1/4, 1/8; Gram against standard NS
  python benchmarks/bench_polar.py --shapes 8x2560x2048 --backends mosaic --no-optax
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import dion3_jax
import pallas_kernels
from _timing import median_ms
from _trace import device_ms

FULL_SHAPES = [(4096, 4096), (4096, 16384), (8192, 28672), (32, 1024, 4096)]
SMALL_SHAPES = [(128, 128), (128, 512), (4, 64, 256)]
#: The polar's inputs in the 7B-shapes step (docs/BENCHMARKS.md), as the step stacks them: Flax
#: ``(in, out)`` kernels keep the selected rows on the last axis. f = 1/4, f = 1/8 (the selected
#: axis padded to the kernels' 128-row tiles, as the step writes it), then f = 1.
STEP_SHAPES = [(32, 4096, 1024), (16, 4096, 2816), (8, 11008, 1024),
               (32, 4096, 512), (16, 4096, 1408), (8, 11008, 512),
               (32, 4096, 4096), (16, 4096, 11008), (8, 11008, 4096)]
DEFAULT_VARIANTS = ("standard:bfloat16", "gram:float16")


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split("x"))


def _variant(text: str) -> tuple[str, str]:
    method, _, dtype = text.partition(":")
    if method not in ("gram", "standard") or dtype not in ("float16", "bfloat16", "float32"):
        raise argparse.ArgumentTypeError(f"want METHOD:DTYPE (gram|standard, float16|bfloat16|"
                                         f"float32), got {text!r}")
    return method, dtype


def _useful_flops(shape, steps=5) -> float:
    *b, n, m = shape
    batch = int(np.prod(b)) if b else 1
    n, m = min(n, m), max(n, m)
    # per step: X Xᵀ (n²m, symmetric), A² (n³, symmetric), B X (2n²m)
    return batch * steps * (n * n * m + n**3 + 2 * n * n * m)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--backends", default="all",
                   help="comma-separated pallas_kernels implementations, or 'all' available")
    p.add_argument("--no-optax", action="store_true", help="skip optax's Newton-Schulz rows")
    p.add_argument("--shapes", nargs="+", default=None, metavar="BxNxM",
                   help="shapes to time, or 'step' (the 7B-shapes step's payload stacks)")
    p.add_argument("--variants", nargs="+", type=_variant, default=None, metavar="METHOD:DTYPE",
                   help=f"methods and compute dtypes (default: {' '.join(DEFAULT_VARIANTS)})")
    args = p.parse_args(argv)
    shapes = SMALL_SHAPES if args.small else FULL_SHAPES
    if args.shapes:
        shapes = [s for t in args.shapes for s in (STEP_SHAPES if t == "step" else [_shape(t)])]
    methods = args.variants or [_variant(v) for v in DEFAULT_VARIANTS]
    dtype = jnp.dtype(args.dtype)
    dev = jax.devices()[0]
    print(f"# device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}, "
          f"input dtype {dtype.name}, median of {args.reps}")
    backends = tuple(b for b in pallas_kernels.available_implementations()
                     if b in ("xla", "mosaic", "jax_triton"))
    if args.backends != "all":
        backends = tuple(args.backends.split(","))
    rows = []
    for shape in shapes:
        x = jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(dtype)
        ref = jax.jit(lambda y: dion3_jax.polar(y.astype(jnp.float32), method="standard",
                                                compute_dtype=jnp.float32))(x)
        variants = [(m, backend, cdt) for backend in backends for m, cdt in methods]
        for method, backend, cdt in variants:
            fn = jax.jit(lambda y, m=method, b=backend, c=cdt: dion3_jax.polar(
                y, method=m, backend=b, compute_dtype=jnp.dtype(c)))
            try:
                ms = median_ms(fn, x, reps=args.reps)
                dev = device_ms(fn, x, reps=min(args.reps, 5))
                out = fn(x).astype(jnp.float32)
                err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
            except Exception as e:  # report, keep going with the other variants
                rows.append((shape, method, backend, cdt, float("nan"), None, float("nan"),
                             f"{type(e).__name__}: {str(e)[:60]}"))
                continue
            rows.append((shape, method, backend, cdt, ms, dev, _useful_flops(shape) / ms / 1e9,
                         f"{err:.2e}"))
        if args.no_optax:
            continue
        # optax's own Newton-Schulz (Jordan coefficients, 5 steps) for reference
        ox = x.astype(jnp.bfloat16)
        jordan = jnp.asarray((3.4445, -4.7750, 2.0315))
        optax_ns = lambda z: optax.contrib._muon.orthogonalize_via_newton_schulz(z, jordan, 5)
        ofn = jax.jit(lambda y: jax.vmap(optax_ns)(y.reshape((-1, *y.shape[-2:]))))
        ms = median_ms(ofn, ox, reps=args.reps)
        rows.append((shape, "optax NS (jordan)", "xla", "bfloat16", ms,
                     device_ms(ofn, ox, reps=min(args.reps, 5)), _useful_flops(shape) / ms / 1e9,
                     "-"))
    hdr = ("shape", "method", "backend", "compute", "ms", "device ms", "TFLOP/s*",
           "rel.err vs f32")
    fmt = "{:<18} {:<18} {:<8} {:<9} {:>9} {:>9} {:>9} {:>16}"
    print(fmt.format(*hdr))
    for shape, method, backend, cdt, ms, dev, tf, err in rows:
        print(fmt.format("x".join(map(str, shape)), method, backend, cdt, f"{ms:.3f}",
                         "-" if dev is None else f"{dev:.3f}", f"{tf:.0f}", err))
    print("* TFLOP/s of standard NS's useful work (symmetric products counted once), 5 steps")


if __name__ == "__main__":
    sys.exit(main())
