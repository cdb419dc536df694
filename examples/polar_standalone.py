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
"""The polar operator on its own: Gram against standard Newton-Schulz, timed and checked.

``dion3_jax.polar(x)`` approximates the polar factor ``U Vᵀ`` of each matrix of a batch (``x = U Σ
Vᵀ``, its SVD): the orthogonal matrix nearest to ``x``, which Dion3 uses as its update
direction. This script runs both methods on a random batch and prints, per method:

- ``ms``: the median wall time of one jitted call after compilation (``--reps`` calls);
- ``error vs SVD``: ``‖O − U Vᵀ‖_F / ‖U Vᵀ‖_F``, the relative distance of the result ``O`` from
  the exact polar factor computed by an SVD in float64;
- ``σ(O)``: the smallest and largest singular values of ``O`` (1 and 1 for an exact polar
  factor; the iteration's polynomials are tuned to bring them near 1 in a few steps, not
  exactly to 1, so errors up to about 10% are expected and harmless for an optimizer).

Then it prints the time ratio standard / Gram. Gram Newton-Schulz iterates on the small
``n × n`` Gram matrix of a wide ``n × m`` input instead of on the input itself, so its advantage
grows with ``m / n``; it is designed for GPUs, and on a CPU the ratio may be near or below 1.

Usage::

    python examples/polar_standalone.py                       # a batch of 8 256×1024 matrices
    python examples/polar_standalone.py --shape 4 512 2048 --dtype bfloat16
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
if importlib.util.find_spec("dion3_jax") is None:  # a source checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(_HERE))

import _common  # noqa: E402

COEFFICIENTS = ("polar_express", "polar_express_4", "you", "jordan")


def parse_args(argv=None):
    """Parses and validates the flags (argparse errors come before JAX starts)."""
    p = _common.make_parser(__doc__)
    p.add_argument("--shape", type=_common.positive_int, nargs=3, default=[8, 256, 1024],
                   metavar=("BATCH", "ROWS", "COLS"), help="batch of matrices to orthogonalize")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the input matrices")
    p.add_argument("--coefficients", default="polar_express", choices=COEFFICIENTS,
                   help="the iteration's polynomial coefficients (a preset of dion3_jax)")
    p.add_argument("--reps", type=_common.positive_int, default=5,
                   help="timed calls per method (the median is printed)")
    return p.parse_args(argv)


def _time(fn, x, reps: int):
    import jax
    import numpy as np

    out = jax.block_until_ready(fn(x))  # compile
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - t0)
    return out, 1e3 * float(np.median(times))


def main(argv=None) -> dict:
    """Runs both methods and prints the comparison; returns ``{method: {ms, rel_err, ...}}``."""
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    import dion3_jax

    x = jax.random.normal(jax.random.key(0), tuple(args.shape), jnp.float32).astype(args.dtype)
    u, _, vt = np.linalg.svd(np.asarray(x, np.float64), full_matrices=False)
    exact = u @ vt
    restarts = dion3_jax.newton_schulz.autotune_restarts(args.coefficients)
    print(f"input: {args.shape[0]} random {args.shape[1]}×{args.shape[2]} matrices, {x.dtype}; "
          f"coefficients {args.coefficients!r}, Gram restarts {restarts}; "
          f"device {jax.devices()[0]}")
    print(f"{'method':<10} {'ms':>8} {'error vs SVD':>13} {'σ(O) min – max':>16}")
    results = {}
    for method in ("gram", "standard"):
        fn = jax.jit(dion3_jax.make_orthogonalizer(method=method,
                                                   coefficients=args.coefficients))
        o, ms = _time(fn, x, args.reps)
        o64 = np.asarray(o, np.float64)
        err = float(np.linalg.norm(o64 - exact) / np.linalg.norm(exact))
        sv = np.linalg.svd(o64, compute_uv=False)
        print(f"{method:<10} {ms:>8.2f} {err:>13.3e} {sv.min():>8.3f} – {sv.max():.3f}")
        results[method] = {"ms": ms, "rel_err": err, "sv_min": float(sv.min()),
                           "sv_max": float(sv.max())}
    ratio = results["standard"]["ms"] / results["gram"]["ms"]
    print(f"standard / Gram time: {ratio:.2f}× (above 1: Gram is faster)")
    print("ms: median of one jitted call after compilation; error vs SVD: ‖O − UVᵀ‖_F / ‖UVᵀ‖_F "
          "against the exact polar factor UVᵀ from a float64 SVD; σ(O): singular values of the "
          "result (1 for an exact polar factor)")
    return results


if __name__ == "__main__":
    main()
