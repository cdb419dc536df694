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
"""``benchmarks/restart_form.py``: the split halves and the restarted Gram matrix against
float64 on fresh random inputs, and the table's smoke run."""

from __future__ import annotations

import importlib
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seeds import module_seed

pytestmark = pytest.mark.tooling

SEED = module_seed()
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _script():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module("restart_form")
    finally:
        sys.path.pop(0)


def test_halves_hold_22_bits_of_a_float32_matrix():
    """``hi + lo·2⁻¹²`` is ``a·s`` to 2⁻²² of its largest entry, also for entries far below
    float16's smallest normal number (float64 reference)."""
    rf = _script()
    rng = np.random.default_rng(SEED)
    a = (rng.standard_normal((2, 48, 48)) * np.logspace(-9, -3, 48)).astype(np.float32)
    with jax.enable_x64(True):
        s = 2.0**12
        hi, lo = rf._halves(jnp.asarray(a), s)
        assert hi.dtype == lo.dtype == jnp.float16
        got = np.asarray(hi, np.float64) + np.asarray(lo, np.float64) * 2.0**-12
        want = a.astype(np.float64) * s
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < 2.0**-22, err
        assert np.abs(np.asarray(hi, np.float64) - want).max() / np.abs(want).max() > 2.0**-16


def test_split_restart_matches_float64_and_float16_r0_does_not():
    """The restarted Gram matrix of ``gram32x2`` is within 3× a fresh Gram matrix's error of
    ``Q R₀ Qᵀ`` in float64, and its most negative eigenvalue within 2× of a fresh one's, while
    ``gram16`` (R₀ rounded to float16) is off by more than either."""
    rf = _script()
    rng = np.random.default_rng(SEED + 1)
    x64 = rf.make_input(64, 256, "decay", rng)
    with jax.enable_x64(True):
        x = jnp.asarray(x64, jnp.float16)
        results = {}
        for form in ("iterate", "gram16", "gram32x2"):
            probe: list = []
            rf.gram_newton_schulz(x, form, probe)
            q, r = (np.asarray(v, np.float64)[0] for v in probe[0])
            xs = np.asarray(x, np.float64)[0]
            exact = q @ (xs @ xs.T) @ q.T
            results[form] = (np.linalg.norm(r - exact, 2), np.linalg.eigvalsh(r).min())
    print(SEED, results)
    (e_it, l_it), (e_16, l_16), (e_32, l_32) = (results[f] for f in ("iterate", "gram16",
                                                                      "gram32x2"))
    assert e_32 < 3 * e_it and l_32 > 2 * min(l_it, 0.0) - 1e-5
    assert e_16 > max(e_it, e_32) and l_16 < min(l_it, l_32)


@pytest.mark.slow  # the table's smoke run; the forms' numerics stay in the fast loop
def test_table_smoke_run(capsys):
    rf = _script()
    rows = rf.main(["--small", "--seed", str(SEED % 1000)])
    assert len(rows) == len(rf.SPECTRA) * len(rf.FORMS)
    out = capsys.readouterr().out
    assert out.count("| 32x128 |") == len(rows)
    for row in rows:
        products = float(row[3])
        assert products == (1.5 * 4 if row[2] == "iterate" else sum(rf.COST[row[2]]))
        if row[2] in ("iterate", "gram32x2"):   # gram16 may blow up (its row says so)
            assert 0 < float(row[7]) < 1 and float(row[4]) < 1e-2 and float(row[8]) < 1.2
    assert not jax.config.jax_enable_x64   # the script's float64 stays inside it
    assert jnp.zeros(1).dtype == jnp.float32
