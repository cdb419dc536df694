"""The polar operator on its own: jit, batch, compare methods, check orthogonality.

Usage:
  python examples/polar_standalone.py                       # a batch of 8 256×1024 matrices
  python examples/polar_standalone.py --shape 4 512 2048 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import dion3_jax


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs="+", default=[8, 256, 1024])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--coefficients", default="polar_express",
                   choices=sorted(dion3_jax.COEFFICIENT_PRESETS))
    args = p.parse_args(argv)
    x = jax.random.normal(jax.random.key(0), tuple(args.shape), jnp.float32)
    x = x.astype(args.dtype)
    # The exact polar factor U Vᵀ from an SVD in float64, for comparison.
    u, _, vt = np.linalg.svd(np.asarray(x, np.float64), full_matrices=False)
    exact = u @ vt
    results = {}
    print(f"input {tuple(x.shape)} {x.dtype}, coefficients={args.coefficients!r}, "
          f"restarts={dion3_jax.autotune_restarts(args.coefficients)}")
    print(f"{'method':<10} {'ms':>8} {'‖O−UVᵀ‖/‖UVᵀ‖':>16} {'σ range of O':>16}")
    for method in ("gram", "standard"):
        fn = jax.jit(lambda y, m=method: dion3_jax.polar(y, method=m,
                                                         coefficients=args.coefficients))
        jax.block_until_ready(fn(x))
        t0 = time.perf_counter()
        o = jax.block_until_ready(fn(x))
        ms = (time.perf_counter() - t0) * 1e3
        o64 = np.asarray(o, np.float64)
        err = np.linalg.norm(o64 - exact) / np.linalg.norm(exact)
        sv = np.linalg.svd(o64, compute_uv=False)
        print(f"{method:<10} {ms:>8.2f} {err:>16.3e} {sv.min():>7.3f} – {sv.max():.3f}")
        results[method] = {"ms": ms, "rel_err": err, "sv_min": sv.min(), "sv_max": sv.max()}
    return results


if __name__ == "__main__":
    main()
