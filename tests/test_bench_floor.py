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
"""benchmarks/bench_floor.py: the floor's byte and FLOP counts, and its table on the CPU."""

from __future__ import annotations

import collections
import pathlib
import sys

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_floor  # noqa: E402
import _model  # noqa: E402

import dion3_jax  # noqa: E402
from dion3_jax import newton_schulz  # noqa: E402
from dion3_jax._coefficients import get_coefficients  # noqa: E402
from seeds import module_seed  # noqa: E402

pytestmark = pytest.mark.tooling

#: Fresh random inputs per run, printed with every test (tests/seeds.py).
SEED = module_seed()

COLUMNS = ["step", "GB moved", "polar TFLOP", "memory ms", "compute ms", "floor ms",
           "× AdamW floor"]


def _dots(fn, x) -> collections.Counter:
    """``(output rows, output cols, contraction)`` of every matrix product ``fn(x)`` traces."""
    counts: collections.Counter = collections.Counter()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                (contract, _), _ = eqn.params["dimension_numbers"]
                k = eqn.invars[0].aval.shape[contract[0]]
                counts[(*eqn.outvars[0].aval.shape[-2:], k)] += 1
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(x).jaxpr)
    return counts


@pytest.mark.parametrize("shape,method,restarts", [((24, 72), "gram", (2,)),
                                                   ((72, 24), "gram", (1, 3)),
                                                   ((24, 24), "standard", ())])
def test_polar_flops_count_the_products_the_iteration_traces(shape, method, restarts):
    """The floor's FLOPs equal the products of the traced iteration, each Gram-sized one
    counted by its lower triangle."""
    coeffs = get_coefficients("polar_express")
    x = jnp.zeros((1, *shape), jnp.float16)
    if method == "gram":
        dots = _dots(lambda x: newton_schulz.gram_newton_schulz(x, coeffs, restarts,
                                                                backend="xla"), x)
    else:
        dots = _dots(lambda x: newton_schulz.standard_newton_schulz(x, coeffs, backend="xla"), x)
    s, long = min(shape), max(shape)
    if method == "standard":  # square: per step the Gram and Z products and Z·X, all s × s × s
        assert dots == {(s, s, s): 3 * len(coeffs)}
        want = len(coeffs) * (2 * s * (s + 1) * s + 2 * s ** 3)
    else:  # Gram-sized outputs are symmetric (lower triangle); Q·X is a full product
        assert dots[(s, s, s)] == bench_floor.symmetric_products(len(coeffs), restarts)
        want = sum(count * (rows * (rows + 1) * k if rows == cols else 2 * rows * cols * k)
                   for (rows, cols, k), count in dots.items())
    assert bench_floor.polar_flops(*shape, len(coeffs), restarts, method) == want


def test_table_follows_the_stated_formula():
    """Every row: memory ms = bytes / bandwidth, compute ms = FLOPs / rate, floor = their sum;
    AdamW moves 28 bytes per parameter and computes nothing; Dion3's floor falls with f."""
    shapes = _model.model_shapes(**_model.SMALL)
    rng = np.random.default_rng(SEED)
    gbps, tflops = float(rng.uniform(1, 5000)), float(rng.uniform(0.01, 900))
    lines = bench_floor.table(shapes, gbps, tflops)
    assert [c.strip() for c in lines[0].strip("|").split("|")] == COLUMNS
    rows = {r[0]: [float(v) for v in r[1:]]
            for r in ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])}
    assert list(rows) == ["optax.adamw", "dion3 f=1", "dion3 f=0.25", "dion3 f=0.125"]
    params = sum(a * b for a, b in shapes.values())
    assert rows["optax.adamw"][0] == pytest.approx(28 * params / 1e9, abs=1e-3)
    for name, work in [("optax.adamw", bench_floor.adamw_work(shapes)),
                       *((f"dion3 f={f:g}", bench_floor.dion3_work(shapes, f))
                         for f in (1, 0.25, 0.125))]:
        memory, compute, total = bench_floor.floor_ms(work, gbps, tflops)
        assert memory == pytest.approx(work.bytes / gbps / 1e6)
        assert compute == pytest.approx(work.flops / tflops / 1e9)
        got = rows[name]
        assert got[2:5] == pytest.approx([memory, compute, memory + compute], rel=1e-3,
                                         abs=1e-12)   # printed to 4 significant digits
        adamw = bench_floor.floor_ms(bench_floor.adamw_work(shapes), gbps, tflops)[2]
        assert got[4] > 0 and got[5] == pytest.approx(total / adamw, abs=0.006)
    floors = [rows[f"dion3 f={f}"][4] for f in ("1", "0.25", "0.125")]
    assert floors == sorted(floors, reverse=True)


@pytest.mark.slow  # ~2 s: measures both rates
def test_runs_on_the_cpu_at_tiny_sizes(capsys):
    lines = bench_floor.main(["--small", "--copy-mib", "1", "--gemm-n", "64", "--reps", "1"])
    out = capsys.readouterr().out
    assert "GB/s" in out and "TFLOP/s" in out and lines[0] in out
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert float(cells[5]) > 0, line


def test_the_floor_counts_the_method_the_polar_runs():
    """A payload closer to square than ``GRAM_MIN_ASPECT`` is counted as standard NS, as
    ``dion3_jax.polar`` runs it; from that aspect on, and only for a Gram-NS orthogonalizer,
    as Gram NS."""
    gram, _ = bench_floor.default_iteration()
    standard = dion3_jax.make_orthogonalizer(method="standard")
    assert bench_floor.iteration_method(gram, 1024, 1152) == "standard"   # aspect 1.125
    assert bench_floor.iteration_method(gram, 1536, 1152) == "gram"       # aspect 4/3
    assert bench_floor.iteration_method(gram, 512, 512) == "standard"
    assert bench_floor.iteration_method(standard, 512, 4096) == "standard"
