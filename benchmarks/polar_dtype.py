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
"""Which compute dtype for the polar? The rounding each dtype adds, per Newton-Schulz method.

The polar's iteration runs in its compute dtype (``dion3_jax.polar(..., compute_dtype=)``;
float16 by default for Gram Newton-Schulz). TPUs' matrix units take bfloat16, not float16, so
the choice matters there. This script runs the polar on fresh Gaussian matrices in float16,
bfloat16 and float32 with the same coefficients and prints, per method and dtype, the
Frobenius distance from the float32 iteration (the rounding the dtype adds; the polynomial's
own distance from the exact polar factor is the same in every dtype) and the range of the
result's singular values.

Usage::

    python benchmarks/polar_dtype.py                       # CPU, under a minute
    python benchmarks/polar_dtype.py --shape 8 1024 4096 --seeds 3
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import dion3_jax  # noqa: E402

DTYPES = ("float16", "bfloat16", "float32")


def _polar(x: np.ndarray, method: str, dtype: str) -> np.ndarray:
    f = jax.jit(lambda x: dion3_jax.polar(x, method=method, compute_dtype=dtype,
                                          out_dtype=jnp.float32))
    return np.asarray(f(x), np.float64)


def rows(shape, seeds: int, methods=("gram", "standard")) -> list[dict]:
    """One row per (method, dtype): mean relative distance from float32 over ``seeds`` draws
    and the extreme singular values seen."""
    out = []
    xs = [np.random.default_rng(s).standard_normal(shape).astype(np.float32)
          for s in range(seeds)]
    for method in methods:
        refs = [_polar(x, method, "float32") for x in xs]
        for dtype in DTYPES:
            dist, lo, hi = [], np.inf, 0.0
            for x, ref in zip(xs, refs):
                o = _polar(x, method, dtype)
                dist.append(np.linalg.norm(o - ref) / np.linalg.norm(ref))
                sv = np.linalg.svd(o, compute_uv=False)
                lo, hi = min(lo, sv.min()), max(hi, sv.max())
            out.append({"method": method, "dtype": dtype, "distance": float(np.mean(dist)),
                        "sv_min": float(lo), "sv_max": float(hi)})
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs="+", default=[4, 512, 2048],
                   help="input shape (batch..., rows, cols)")
    p.add_argument("--seeds", type=int, default=2, help="fresh Gaussian draws per row")
    args = p.parse_args(argv)
    print(f"# shape {tuple(args.shape)}, {args.seeds} draws, {jax.devices()[0].platform}, "
          f"jax {jax.__version__}")
    print("| method | compute dtype | distance from float32 | singular values |")
    print("|---|---|---|---|")
    for r in rows(tuple(args.shape), args.seeds):
        print(f"| {r['method']} | {r['dtype']} | {r['distance']:.2e} | "
              f"{r['sv_min']:.3f}–{r['sv_max']:.3f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
