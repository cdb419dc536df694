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
"""The per-matrix maths of dion3_jax._rules, each alone, against float64 NumPy on fresh inputs."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dion3_jax import _rules, _selection
from seeds import module_seed

#: Fresh random inputs per run, printed with every test (tests/seeds.py).
SEED = module_seed()


def _rng():
    return np.random.default_rng(SEED)


@pytest.mark.parametrize("row_axis", [1, 2])
def test_error_feedback_decays_only_the_selected_rows(row_axis):
    rng = _rng()
    m = rng.standard_normal((2, 6, 5)).astype(np.float32)        # rows on axis 1
    rows = np.sort(rng.permutation(6)[:3])[None].repeat(2, 0)
    sel = np.take_along_axis(m, rows[:, :, None], axis=1)
    mu = np.float32(0.9)
    want = m.astype(np.float64).copy()
    np.put_along_axis(want, rows[:, :, None], 0.9 * sel.astype(np.float64), axis=1)
    if row_axis == 2:
        m, sel, want = (np.swapaxes(a, 1, 2) for a in (m, sel, want))
    src = _selection.row_sources(_selection.row_positions(jnp.asarray(rows), 6), 3)
    got = _rules.error_feedback(jnp.asarray(m), jnp.asarray(sel), jnp.asarray(mu), src, row_axis)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)
    full = _rules.error_feedback(jnp.asarray(m), jnp.asarray(m), jnp.asarray(mu), None, row_axis)
    np.testing.assert_allclose(np.asarray(full), 0.9 * m.astype(np.float64), rtol=1e-6)
    # S omitted: the block's own rows decay in place, bitwise as when S is gathered from it.
    own = _rules.error_feedback(jnp.asarray(m), None, jnp.asarray(mu), src, row_axis)
    np.testing.assert_array_equal(np.asarray(own), np.asarray(got))
    own_full = _rules.error_feedback(jnp.asarray(m), None, jnp.asarray(mu), None, row_axis)
    np.testing.assert_array_equal(np.asarray(own_full), np.asarray(full))


def _normuon_f64(o, v, beta2):
    """NorMuon on one (k × C) matrix, float64."""
    v_new = beta2 * v + (1 - beta2) * (o ** 2).mean(axis=1)
    d = o / (np.sqrt(v_new)[:, None] + 1e-8)
    return d * np.linalg.norm(o) / max(np.linalg.norm(d), 1e-8), v_new


@pytest.mark.parametrize("row_axis", [1, 2])
def test_normuon_against_float64(row_axis):
    rng = _rng()
    o = rng.standard_normal((3, 5, 12))
    v = rng.random((3, 5)) * 0.1
    want = [_normuon_f64(o[b], v[b], 0.95) for b in range(3)]
    x = o if row_axis == 1 else np.swapaxes(o, 1, 2)
    d, v_new = _rules.normuon(jnp.asarray(x, jnp.float32), jnp.asarray(v, jnp.float32),
                              jnp.float32(0.95), row_axis)
    d = np.asarray(d) if row_axis == 1 else np.swapaxes(np.asarray(d), 1, 2)
    for b, (wd, wv) in enumerate(want):
        np.testing.assert_allclose(d[b], wd, rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(v_new)[b], wv, rtol=2e-5)
        # The rescale keeps the Frobenius norm of O.
        assert math.isclose(np.linalg.norm(d[b]), np.linalg.norm(o[b]), rel_tol=1e-5)


def test_normuon_pieces_compose_over_shards():
    """The step's sharded form: row sums of squares summed over column shards and Frobenius
    terms over row shards give the whole-matrix result."""
    rng = _rng()
    o = rng.standard_normal((1, 8, 10)).astype(np.float32)
    v = (rng.random((1, 8)) * 0.1).astype(np.float32)
    whole, v_whole = _rules.normuon(jnp.asarray(o), jnp.asarray(v), 0.95)
    halves = [o[:, :, :5], o[:, :, 5:]]                              # column shards
    row_sq = sum(_rules.row_sq_norms(jnp.asarray(h), 1) for h in halves)
    v_new, a, fro = _rules.normuon_moments(jnp.asarray(v), row_sq, 10, 0.95)
    parts = [_rules.normuon_directions(jnp.asarray(h), a, fro, 1) for h in halves]
    np.testing.assert_allclose(np.concatenate([np.asarray(p) for p in parts], axis=2),
                               np.asarray(whole), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(v_new), np.asarray(v_whole), rtol=1e-6)


def test_muon_directions_are_the_factors_in_float32():
    o = jnp.asarray(_rng().standard_normal((2, 4, 6)), jnp.float16)
    d = _rules.muon_directions(o)
    assert d.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(d), np.asarray(o, np.float32))


@pytest.mark.parametrize("adjust,fan_out,fan_in,want", [
    ("spectral_norm", 64, 16, 2.0),
    ("spectral_norm", 16, 64, 0.5),
    ("rms_norm", 64, 16, 0.2 * 8.0),
    ("rms_norm", 16, 100, 0.2 * 10.0),
    (None, 64, 16, 1.0),
])
def test_lr_scale(adjust, fan_out, fan_in, want):
    assert math.isclose(_rules.lr_scale(adjust, fan_out, fan_in), want, rel_tol=1e-12)


def test_rules_are_jittable():
    o = jnp.ones((1, 4, 8))
    jax.jit(_rules.normuon, static_argnums=3)(o, jnp.zeros((1, 4)), 0.95, 1)
