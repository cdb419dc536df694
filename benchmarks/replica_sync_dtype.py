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
"""Can the compressed sync's cross-replica all-reduce of the selected rows travel in 16 bits?

Under compressed sync (``MeshOptions(replica_axis="dcn")``) each replica r holds its own momentum
``M_r`` and the step averages only the selected rows, ``S = mean_r M_r[I]``, over the slow
``"dcn"`` axis; ``S`` is then orthogonalized and written back into the momentum
(``M_r[I] ← μ·S``, error feedback). Today that average travels in float32. This script measures
what a 16-bit wire would cost, emulating a ring all-reduce that adds the replicas' payloads one
after another in the wire dtype:

* **float32**: today's wire (the reference point).
* **float16, scaled**: every replica divides by a shared scale (the largest ``|entry|`` of the
  matrix over the replicas, one float all-reduced with ``pmax``) before casting, so each
  summand lies in [−1, 1] and the sum of R payloads cannot overflow; the scale is multiplied
  back after the sum. This is ``MeshOptions(replica_wire_dtype=jnp.float16)``
  (``dion3_jax._collectives.replica_mean``).
* **bfloat16, scaled**: the same with 8 mantissa bits.

Two effects are reported:

1. **The update.** The polar factor of the averaged rows with Dion3's default orthogonalizer
   (float16 Gram Newton-Schulz) against the same Newton-Schulz run in float32 on the exact
   (float64) average: the orthogonalizer already casts its input to float16, so a 16-bit wire
   only adds the rounding of the R − 1 additions.
2. **The momentum.** ``T`` steps of the compressed rule on random gradients (shared selection,
   error feedback with the averaged rows), with each wire against the float64 run: the relative
   distance of the momenta after each step (rounding errors decay by μ each time a row is
   selected, so they do not build up).

Usage::

    python benchmarks/replica_sync_dtype.py              # 512 × 2048 rows block, R = 2…16
    python benchmarks/replica_sync_dtype.py --rows 256 --cols 1024 --trials 5
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

WIRES = {"float32": jnp.float32, "float16 scaled": jnp.float16, "bfloat16 scaled": jnp.bfloat16}


def ring_mean(parts: np.ndarray, wire) -> np.ndarray:
    """Mean over axis 0 as a ring all-reduce in ``wire`` computes it: the payloads (divided by
    a shared scale for 16-bit wires) added one after another in the wire dtype."""
    if wire == jnp.float32:
        scale = 1.0
    else:
        scale = max(float(np.abs(p).max()) for p in parts)
    acc = jnp.asarray(parts[0] / scale, wire)
    for p in parts[1:]:
        acc = (acc + jnp.asarray(p / scale, wire)).astype(wire)
    return np.asarray(acc, np.float64) * scale / len(parts)


def rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def update_errors(rng, rows, cols, replicas, trials, noise):
    """Per wire: mean relative error of the averaged rows and of the update."""
    exact_polar = jax.jit(lambda x: dion3_jax.polar(x, compute_dtype=jnp.float32))
    default_polar = jax.jit(lambda x: dion3_jax.polar(x, out_dtype=jnp.float32))
    out = {w: [0.0, 0.0] for w in WIRES}
    for _ in range(trials):
        common = rng.standard_normal((rows, cols))
        parts = common + noise * rng.standard_normal((replicas, rows, cols))
        exact = parts.mean(0)
        reference = np.asarray(exact_polar(jnp.asarray(exact, jnp.float32)), np.float64)
        for name, wire in WIRES.items():
            mean = ring_mean(parts, wire)
            out[name][0] += rel(mean, exact) / trials
            out[name][1] += rel(default_polar(jnp.asarray(mean, jnp.float32)), reference) / trials
    return out


def momentum_drift(rng, rows, cols, replicas, steps, fraction, mu):
    """Per wire: relative distance of the momenta from the float64 run after ``steps`` steps."""
    k = max(1, int(np.ceil(fraction * rows)))
    momenta = {w: np.zeros((replicas, rows, cols)) for w in list(WIRES) + ["float64"]}
    for _ in range(steps):
        grads = rng.standard_normal((rows, cols)) + rng.standard_normal((replicas, rows, cols))
        rows_i = rng.permutation(rows)[:k]  # the shared (random) selection
        for name, m in momenta.items():
            m += grads
            sel = m[:, rows_i]
            mean = sel.mean(0) if name == "float64" else ring_mean(sel, WIRES[name])
            m[:, rows_i] = mu * mean
    ref = momenta["float64"]
    return {w: rel(momenta[w], ref) for w in WIRES}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=512, help="selected rows per matrix")
    p.add_argument("--cols", type=int, default=2048)
    p.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--trials", type=int, default=3, help="random matrices per cell")
    p.add_argument("--noise", type=float, default=1.0,
                   help="replica-to-replica spread of the momenta relative to their mean")
    p.add_argument("--steps", type=int, default=60, help="steps of the momentum experiment")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    rng = np.random.default_rng(a.seed)
    print(f"# {a.rows}×{a.cols} selected rows, replica spread {a.noise:g}, {a.trials} trials; "
          f"momentum: {a.steps} steps of a {a.rows // 4}×{a.cols // 4} matrix per replica at "
          f"f = 1/4, μ = 0.95^4")
    print("\n| replicas | wire | ‖S − S_exact‖/‖S‖ | update error | momentum distance |")
    print("|---:|---|---:|---:|---:|")
    for r in a.replicas:
        upd = update_errors(rng, a.rows, a.cols, r, a.trials, a.noise)
        drift = momentum_drift(rng, a.rows // 4, a.cols // 4, r, a.steps, 0.25, 0.95 ** 4)
        for w in WIRES:
            print(f"| {r} | {w} | {upd[w][0]:.2e} | {upd[w][1]:.2e} | {drift[w]:.2e} |",
                  flush=True)


if __name__ == "__main__":
    main()
