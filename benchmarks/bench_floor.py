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
"""The written floor of the optimizer step on this device: memory traffic plus the polar's work.

Measures two rates on the current device: the copy bandwidth (``y = x + 1`` on a large float32
array, one read and one write per element: GB/s) and the dense float16 GEMM rate (``n × n`` by
``n × n``, ``2n³`` FLOPs, float16 result: TFLOP/s). Then, on the benchmarks' model
(``_model.py``'s shape list), it prints for each fraction ``f`` the floor of one Dion3 step and
of one AdamW step, in ms::

    floor = bytes / bandwidth + polar FLOPs / GEMM rate

- **Bytes.** Dion3: every matrix's parameters, gradients and momentum read once, parameters and
  momentum written once (5 × 4 bytes per float32 parameter), and the polar's float16 input and
  output each written once and read once (4 × 2 bytes per selected element, ``k × fan_in`` per
  matrix, ``k = max(1, ceil(f · fan_out))``). AdamW: parameters, gradients and both moments
  read, parameters and both moments written (7 × 4 bytes per parameter). Per-row vectors (the
  row factors, NorMuon's second moments) are left out: under 0.1% of the bytes.
- **FLOPs.** Dion3's default orthogonalizer on each selected ``k × fan_in`` payload, short side
  ``s``, long side ``L``. Gram Newton-Schulz (``L ≥ 4/3 · s``, as ``dion3_jax.polar`` picks
  it): ``1 + r`` Gram products (``syrk``,
  ``s(s+1)·L`` FLOPs: the lower triangle, 2 FLOPs per multiply-add), the symmetric products of
  the iteration (``s(s+1)·s`` each; 14 for the 5-step Polar Express schedule with one restart)
  and ``1 + r`` products ``Q·X`` (``2s²L``), ``r`` the number of restarts. Payloads closer to
  square (``f = 1`` on the d×d matrices) run standard Newton-Schulz: per step one Gram
  product, one symmetric product and one ``Z·X`` (``s(s+1)·L + s(s+1)·s + 2s²L``). AdamW:
  none.

The floor is what the step would take if it moved only those bytes at the copy bandwidth and ran
only those products at the GEMM rate, one after the other: no elementwise work, no overlap.

Usage::

    python benchmarks/bench_floor.py                        # the 7B-shapes model (GPU)
    python benchmarks/bench_floor.py --small --copy-mib 4 --gemm-n 128 --reps 1   # CPU smoke
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp

try:
    import dion3_jax
except ImportError:  # running from a source checkout
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import dion3_jax
from dion3_jax import _polar
from dion3_jax.newton_schulz import get_coefficients
from dion3_jax._selection import num_selected
from _timing import best_ms_rotated
from _model import FULL, SMALL, model_shapes

#: Bytes per float32 parameter that each step must move (module docstring).
DION3_BYTES_PER_PARAM = 5 * 4
ADAMW_BYTES_PER_PARAM = 7 * 4
#: Bytes per selected payload element: the float16 input and output, each written and read.
PAYLOAD_BYTES_PER_ELEMENT = 4 * 2
FRACTIONS = (1.0, 0.25, 0.125)


def copy_gbps(mib: int, reps: int, sets: int = 8) -> float:
    """Copy bandwidth in GB/s: ``y = x + 1`` on float32 arrays of ``mib`` MiB (read + write),
    ``sets`` different arrays per timed call."""
    n = mib * 2**20 // 4
    xs = [(jnp.full((n,), float(i), jnp.float32),) for i in range(sets)]
    ms = best_ms_rotated(lambda x: x + 1.0, xs, reps=reps)
    return 2 * 4 * n / (ms * 1e-3) / 1e9


def gemm_tflops(n: int, reps: int, sets: int = 4) -> float:
    """Dense float16 GEMM rate in TFLOP/s: ``n × n`` by ``n × n``, float16 result."""
    key = jax.random.key(0)
    args = [tuple(jax.random.normal(jax.random.fold_in(key, 2 * i + j), (n, n), jnp.float16)
                  for j in range(2)) for i in range(sets)]
    ms = best_ms_rotated(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float16),
                         args, reps=reps)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def _sym(n: int, k: int) -> int:
    """FLOPs of a symmetric ``n × n`` product with contraction ``k``: its lower triangle."""
    return n * (n + 1) * k


def symmetric_products(steps: int, restarts) -> int:
    """The symmetric products of a Gram Newton-Schulz iteration of ``steps`` steps restarting at
    ``restarts``: per step one for ``Z``, one for ``Q`` unless the step (re)starts, and two for
    ``R``'s next value unless the step is the last one or the next one restarts."""
    restart = set(restarts)
    count = 0
    for i in range(steps):
        count += 1 + (i != 0 and i not in restart) + 2 * (i != steps - 1 and i + 1 not in restart)
    return count


def gram_starts(steps: int, restarts) -> int:
    """Gram Newton-Schulz's (re)starts: ``1 + r``, each one Gram product and one ``Q·X``."""
    return 1 + len([r for r in restarts if 0 < r < steps])


def default_iteration():
    """``(orthogonalizer, steps)``: Dion3's default orthogonalizer and its number of steps."""
    orth = dion3_jax.make_orthogonalizer()
    return orth, len(get_coefficients(orth.coefficients, orth.steps))


def iteration_method(orth, rows: int, cols: int) -> str:
    """The Newton-Schulz form ``orth`` runs on a ``rows × cols`` payload: Gram NS where its
    method is Gram NS and the long side is at least ``GRAM_MIN_ASPECT`` times the short one
    (``dion3_jax._polar.runs_gram``, the rule ``dion3_jax.polar`` follows), else standard NS."""
    return "gram" if _polar.runs_gram(orth.method, rows, cols) else "standard"


def polar_flops(rows: int, cols: int, steps: int, restarts, method: str = "gram") -> int:
    """FLOPs of one polar of a ``rows × cols`` payload (module docstring)."""
    s, long = min(rows, cols), max(rows, cols)
    if method == "gram" and rows != cols:
        return (gram_starts(steps, restarts) * (_sym(s, long) + 2 * s * s * long)
                + symmetric_products(steps, restarts) * _sym(s, s))
    return steps * (_sym(s, long) + _sym(s, s) + 2 * s * s * long)


class Work(NamedTuple):
    """What one step must do: bytes moved and the polar's FLOPs."""

    bytes: int
    flops: int


def dion3_work(shapes: dict[str, tuple[int, int]], fraction: float) -> Work:
    """Dion3's work at ``fraction`` on a Flax-layout ``(fan_in, fan_out)`` shape list, with the
    default orthogonalizer's method, steps and restarts."""
    orth, steps = default_iteration()
    total_bytes = flops = 0
    for fan_in, fan_out in shapes.values():
        k = num_selected(fraction, fan_out)
        total_bytes += DION3_BYTES_PER_PARAM * fan_in * fan_out
        total_bytes += PAYLOAD_BYTES_PER_ELEMENT * k * fan_in
        flops += polar_flops(k, fan_in, steps, orth.restarts,
                             iteration_method(orth, k, fan_in))
    return Work(total_bytes, flops)


def adamw_work(shapes: dict[str, tuple[int, int]]) -> Work:
    return Work(sum(ADAMW_BYTES_PER_PARAM * a * b for a, b in shapes.values()), 0)


def floor_ms(work: Work, gbps: float, tflops: float) -> tuple[float, float, float]:
    """``(memory ms, compute ms, floor ms)``: bytes / bandwidth, FLOPs / GEMM rate, their sum."""
    memory = work.bytes / (gbps * 1e9) * 1e3
    compute = work.flops / (tflops * 1e12) * 1e3
    return memory, compute, memory + compute


def table(shapes, gbps: float, tflops: float, fractions=FRACTIONS) -> list[str]:
    """The floor table's lines (markdown)."""
    adamw = floor_ms(adamw_work(shapes), gbps, tflops)[2]
    lines = ["| step | GB moved | polar TFLOP | memory ms | compute ms | floor ms "
             "| × AdamW floor |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    rows = [("optax.adamw", adamw_work(shapes))]
    rows += [(f"dion3 f={f:g}", dion3_work(shapes, f)) for f in fractions]
    for name, work in rows:
        memory, compute, total = floor_ms(work, gbps, tflops)
        lines.append(f"| {name} | {work.bytes / 1e9:.3f} | {work.flops / 1e12:.4f} | "
                     f"{memory:.4g} | {compute:.4g} | {total:.4g} | {total / adamw:.2f} |")
    return lines


def main(argv=None) -> list[str]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="tiny model (CPU smoke check)")
    p.add_argument("--copy-mib", type=int, default=1024, help="MiB per copied array")
    p.add_argument("--gemm-n", type=int, default=8192, help="side of the float16 GEMM")
    p.add_argument("--reps", type=int, default=20,
                   help="timed calls per rate (the fastest is kept), after one more untimed")
    p.add_argument("--fractions", type=float, nargs="+", default=list(FRACTIONS))
    a = p.parse_args(argv)
    cfg = SMALL if a.small else FULL
    shapes = model_shapes(**cfg)
    dev = jax.devices()[0]
    gbps = copy_gbps(a.copy_mib, a.reps)
    tflops = gemm_tflops(a.gemm_n, a.reps)
    print(f"# device: {dev.device_kind} ({dev.platform}); jax {jax.__version__}; model "
          f"{cfg['layers']} layers d={cfg['d']} ff={cfg['ff']}")
    print(f"# copy bandwidth: {gbps:.1f} GB/s ({a.copy_mib} MiB float32, y = x + 1); "
          f"float16 GEMM: {tflops:.2f} TFLOP/s ({a.gemm_n}³); best of {a.reps} after "
          f"{a.reps + 1} untimed")
    print("# floor = bytes / bandwidth + polar FLOPs / GEMM rate")
    lines = table(shapes, gbps, tflops, a.fractions)
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
