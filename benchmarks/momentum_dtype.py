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
"""Which momentum dtype for 16-bit parameters? Measures accumulation error and overflow.

Dion3's momentum accumulates ``M ← M + G`` and only the selected rows decay, so a row that is
rarely selected sums many gradients. This script runs ``scale_by_dion3`` for ``--steps`` steps on
one matrix with momentum in float16, bfloat16 (both rounded stochastically, as the library does)
and float32, against the same run in float64, and prints per dtype: whether the momentum stayed
finite, the relative error of the momentum and of the last update.
The gradients have a per-row scale spread over two decades (rows with small ℓ1 norms are
selected rarely) and a slowly drifting mean.

Usage::

    python benchmarks/momentum_dtype.py                 # CPU, about a minute
    python benchmarks/momentum_dtype.py --grad-scale 50 --fraction 0.125
"""

from __future__ import annotations

import argparse
import os
import sys

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import dion3_jax  # noqa: E402
import pallas_kernels  # noqa: E402
from dion3_jax import _rounding  # noqa: E402


def _grads(steps: int, shape, scale: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    row_scale = np.logspace(-1, 1, shape[1])[None, :] * scale      # (in, out): rows = out
    drift = rng.standard_normal(shape)
    return np.stack([(0.3 * drift + rng.standard_normal(shape)) * row_scale
                     for _ in range(steps)])


def _run(grads: np.ndarray, fraction: float, mu, mu_dtype, polar_dtype):
    tx = dion3_jax.scale_by_dion3(
        fraction, mu, orthogonalizer=dion3_jax.make_orthogonalizer(
            method="standard", compute_dtype=polar_dtype, backend="xla"),
        mu_dtype=mu_dtype)
    params = {"w": jnp.zeros(grads.shape[1:], jnp.float64)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    for g in grads:
        u, state = update({"w": jnp.asarray(g)}, state)
    return np.asarray(state.full_momentum()["w"], np.float64), np.asarray(u["w"], np.float64)


def _row_sum_error(grads: np.ndarray, dtype, nearest: bool) -> float:
    """The relative error of ``Σ_t G_t`` summed in a ``dtype`` momentum (``grads``:
    ``(steps, cols)`` float32) against its float64 sum."""
    stochastic = not nearest and _rounding.stochastic(dtype)

    def body(m, xs):
        g, t = xs
        key = _rounding.step_key(0, t, 0, _rounding.SUM)
        bits = _rounding.momentum_bits(key, m.shape) if stochastic else None
        return pallas_kernels.scaled_sum(m, g, jnp.ones((), jnp.float32), bits), None

    steps = jnp.arange(grads.shape[0], dtype=jnp.int32)
    m = jax.jit(lambda g: jax.lax.scan(body, jnp.zeros(g.shape[1:], dtype), (g, steps))[0])(
        jnp.asarray(grads, jnp.float32))
    ref = grads.astype(np.float64).sum(axis=0)
    return float(np.linalg.norm(np.asarray(m, np.float64) - ref) / np.linalg.norm(ref))


def _row_table(row_steps, cols: int, seed: int) -> None:
    """Prints :func:`_row_sum_error` per dtype and rounding for each number of steps: gradients
    ``d + N(0, 1)`` with a per-entry mean ``d ~ N(0, 0.3²)``."""
    rng = np.random.default_rng(seed)
    print(f"\none row never selected, {cols} entries, G = d + N(0, 1), d ~ N(0, 0.3^2): "
          f"relative error of the summed M against float64")
    kinds = [(jnp.float16, True), (jnp.float16, False), (jnp.bfloat16, True),
             (jnp.bfloat16, False), (jnp.float32, True)]
    print(f"{'steps':>6} | " + " | ".join(
        f"{jnp.dtype(t).name + (' nearest' if n else ' stochastic'):>19}" for t, n in kinds))
    for steps in row_steps:
        g = (0.3 * rng.standard_normal(cols) + rng.standard_normal((steps, cols)))
        errs = [_row_sum_error(g.astype(np.float32), t, n) for t, n in kinds]
        print(f"{steps:>6} | " + " | ".join(f"{e:19.2e}" for e in errs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=400, help="optimizer steps")
    p.add_argument("--rows", type=int, default=256, help="output rows of the matrix")
    p.add_argument("--cols", type=int, default=128, help="input columns of the matrix")
    p.add_argument("--fraction", type=float, default=0.125, help="Dion3 fraction f")
    p.add_argument("--grad-scale", type=float, default=1.0, help="gradient scale")
    p.add_argument("--mu", type=float, default=0.95,
                   help="error-feedback decay (0.95: the reference's constant; the library's "
                        "default is 0.95^(1/f))")
    p.add_argument("--seed", type=int, default=0, help="gradient seed")
    p.add_argument("--row-steps", type=int, nargs="*", default=[400, 1000, 4000, 10000],
                   help="steps of the never-selected row's sums (none: skip that table)")
    args = p.parse_args()
    grads = _grads(args.steps, (args.cols, args.rows), args.grad_scale, args.seed)
    ref_m, ref_u = _run(grads, args.fraction, args.mu, jnp.float64, jnp.float64)
    print(f"steps {args.steps}, matrix {args.rows}x{args.cols}, f = {args.fraction}, "
          f"mu = {args.mu}, "
          f"gradient scale {args.grad_scale}; max |M| in float64: {np.abs(ref_m).max():.3g}")
    print(f"{'momentum':>9} | {'rounding':>10} | {'finite':>6} | {'rel err M':>9} | "
          f"{'rel err update':>14}")
    for dtype in (jnp.float16, jnp.bfloat16, jnp.float32):
        m, u = _run(grads, args.fraction, args.mu, dtype, jnp.float64)
        finite = bool(np.all(np.isfinite(m)))
        err_m = np.linalg.norm(m - ref_m) / np.linalg.norm(ref_m) if finite else float("nan")
        err_u = (np.linalg.norm(u - ref_u) / np.linalg.norm(ref_u)
                 if np.all(np.isfinite(u)) else float("nan"))
        rounding = "stochastic" if _rounding.stochastic(dtype) else "nearest"
        print(f"{jnp.dtype(dtype).name:>9} | {rounding:>10} | {str(finite):>6} | {err_m:9.2e} | "
              f"{err_u:14.2e}")
    _row_table(args.row_steps, args.cols, args.seed)


if __name__ == "__main__":
    main()
