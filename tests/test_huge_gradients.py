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
"""Huge but finite gradients: the summed momentum saturates at ±2⁷⁹ (``pallas_kernels.scaled_sum``),
so its norms stay finite and every finite gradient gives a finite update and a finite state.

Before the saturation, a matrix norm above about 7e28 made the payload norm NaN: the update was
NaN and NorMuon's second moments stayed NaN for every later step, while
``optax.apply_if_finite`` (which checks the gradients it is given, finite here) skipped nothing.
The references are float64 (``dion3_reference``) of the documented rule, ``S`` clipped to
``±2⁷⁹``; the tolerance is the default float16 polar's (2e-2 relative, as in
``tests/test_transform.py::test_default_precision_close_to_reference``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dion3_jax
import dion3_reference as ref
import pallas_kernels
from seeds import module_seed

#: Fresh random inputs per run, printed with every test (tests/seeds.py).
SEED = module_seed()

SHAPE = (32, 64)
SAT = 2.0 ** 79
SCALES = (1e28, 1e30, 1e33, 1e36, 1e37)
FLAVORS = [(1.0, "normuon"), (0.25, "normuon"), (1.0, "muon"), (0.25, "muon")]


def _finite(tree) -> bool:
    return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(tree)
               if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating))


def _reference_update(g: np.ndarray, f: float, flavor: str) -> np.ndarray:
    """The float64 first-step direction of ``scale_by_dion3`` from a zero state, ``S`` clipped
    (a 2-D leaf is ``(in, out)``: the reference's ``(out × in)`` matrix is its transpose)."""
    s = np.clip(g.astype(np.float64), -SAT, SAT).T
    n, c = s.shape
    w, _, _ = ref.dion3_matrix_step(np.zeros((n, c)), s, np.zeros((n, c)), np.zeros(n), lr=1.0,
                                    f=f, mu=0.5, beta2=0.95, wd=0.0, flavor=flavor,
                                    adjust="spectral_norm")
    return -w.T


def _float32(x: np.ndarray) -> np.ndarray:
    """``x`` in float32, where magnitudes past float32's range become ±inf on purpose."""
    with np.errstate(over="ignore"):
        return x.astype(np.float32)


def _huge_inputs(rng) -> list[tuple[str, np.ndarray]]:
    """Random matrices ×1e28…1e37, a single huge entry, a huge row (all finite in float32)."""
    cases = [(f"x{s:.0e}", (rng.standard_normal(SHAPE) * s).astype(np.float32)) for s in SCALES]
    one = rng.standard_normal(SHAPE).astype(np.float32)
    one[3, 7] = 3e38
    row = rng.standard_normal(SHAPE).astype(np.float32)
    row[:, 5] *= 1e35          # output neuron 5 (a leaf is (in, out)): one huge matrix row
    return cases + [("entry3e38", one), ("row1e35", row)]


@pytest.mark.parametrize("f,flavor", FLAVORS)
def test_huge_finite_gradients_give_finite_updates_close_to_reference(f, flavor):
    """Each huge input, from a zero state: a finite update within 2e-2 of the float64 rule, a
    finite state, and finite updates for the normal gradients after it."""
    rng = np.random.default_rng(SEED)
    tx = dion3_jax.scale_by_dion3(f, mu=0.5, beta2=0.95, flavor=flavor)
    step = jax.jit(tx.update)
    params = {"w": jnp.zeros(SHAPE, jnp.float32)}
    for name, g in _huge_inputs(rng):
        u, state = step({"w": jnp.asarray(g)}, tx.init(params))
        assert _finite(u) and _finite(state), name
        want = _reference_update(g, f, flavor)
        rel = np.linalg.norm(np.asarray(u["w"]) - want) / np.linalg.norm(want)
        assert rel < 2e-2, (name, rel)
        for _ in range(2):
            u, state = step({"w": jnp.asarray(rng.standard_normal(SHAPE), jnp.float32)}, state)
            assert _finite(u) and _finite(state), name


@pytest.mark.parametrize("f,flavor", [(1.0, "normuon"), (0.25, "muon")])
def test_apply_if_finite_training_stays_finite_through_huge_gradients(f, flavor):
    """Under ``optax.apply_if_finite``: huge finite gradients are applied (finite updates), a
    gradient that overflows to inf in float32 is skipped, and every later normal step is finite."""
    rng = np.random.default_rng(SEED)
    tx = optax.apply_if_finite(dion3_jax.dion3(0.02, f, flavor=flavor,
                                               param_labels=lambda p: {"w": "dion3"}),
                               max_consecutive_errors=3)
    params = {"w": jnp.asarray(rng.standard_normal(SHAPE), jnp.float32)}
    state, step = tx.init(params), jax.jit(tx.update)
    normal = [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(3)]
    seq = [normal[0], *(g for _, g in _huge_inputs(rng)),
           _float32(rng.standard_normal(SHAPE) * 1e39), *normal[1:]]
    for i, g in enumerate(seq):
        u, state = step({"w": jnp.asarray(g)}, state, params)
        params = optax.apply_updates(params, u)
        assert _finite(u) and _finite(state.inner_state), i
        assert int(state.notfinite_count) == int(not np.all(np.isfinite(g))), i
    assert int(state.total_notfinite) == 1


@pytest.mark.parametrize("f,flavor", [(0.25, "normuon"), (1.0, "muon")])
def test_no_nonfinite_state_behind_a_finite_update(f, flavor):
    """Without ``apply_if_finite``, over gradients ×1e28…1e39 (the last one inf in float32)
    applied one after another: whenever the update is finite, so is the whole state."""
    rng = np.random.default_rng(SEED)
    tx = dion3_jax.scale_by_dion3(f, flavor=flavor)
    params = {"w": jnp.zeros(SHAPE, jnp.float32)}
    state, step = tx.init(params), jax.jit(tx.update)
    for scale in (*SCALES, 3e37, 1e38, 1e39):
        g = _float32(rng.standard_normal(SHAPE) * scale)
        u, state = step({"w": jnp.asarray(g)}, state)
        assert not _finite(u) or _finite(state), scale
        assert _finite(u) == bool(np.all(np.isfinite(g))), scale


def test_scaled_sum_saturates_finite_overflow_only():
    """``S = d·M + G`` saturates at ±2⁷⁹ (±65504 for a float16 ``M``), keeps inf and NaN of
    non-finite operands, and is bitwise the plain float32 formula below the bound."""
    rng = np.random.default_rng(SEED)
    m = jnp.asarray(rng.standard_normal((4, 8)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((4, 8)), jnp.float32)
    d = jnp.asarray(rng.uniform(0.5, 1.0, (4, 1)), jnp.float32)
    plain = d * m + g
    np.testing.assert_array_equal(np.asarray(pallas_kernels.scaled_sum(m, g, d)),
                                  np.asarray(plain))
    big = jnp.asarray([[3e38, -3e38, 1e30, 1.0, np.inf, -np.inf, np.nan, 2e38]], jnp.float32)
    out = np.asarray(pallas_kernels.scaled_sum(big, big, jnp.ones((1, 1))))
    np.testing.assert_array_equal(out[0, :4], [SAT, -SAT, SAT, 2.0])
    assert out[0, 4] == np.inf and out[0, 5] == -np.inf and np.isnan(out[0, 6])
    assert out[0, 7] == SAT
    # One non-finite operand beside a finite one (of either sign or size) still passes through.
    finite = jnp.asarray([[1.0, -1.0, 3e38, -3e38]], jnp.float32)
    for bad in (np.inf, -np.inf, np.nan):
        bad = jnp.full_like(finite, bad)
        for m_, g_ in ((bad, finite), (finite, bad)):
            got = np.asarray(pallas_kernels.scaled_sum(m_, g_, jnp.ones((1, 1))))
            np.testing.assert_array_equal(got, np.asarray(m_ + g_))
    half = pallas_kernels.scaled_sum(jnp.full((1, 2), 6e4, jnp.float16),
                                     jnp.full((1, 2), 6e4, jnp.float16), jnp.ones((1, 1)))
    assert half.dtype == jnp.float16 and float(half[0, 0]) == 65504.0


@pytest.mark.parametrize("row_axis", [1, 2])
def test_statistics_kernel_sums_stay_finite_for_huge_inputs(row_axis):
    """The statistics pass (kernel in the interpreter and its jnp form, bitwise equal) on huge
    finite inputs: ``S`` saturated, finite ℓ1 norms and sums of squares."""
    rng = np.random.default_rng(SEED)
    m = jnp.asarray(rng.standard_normal((2, 32, 32)) * 1e37, jnp.float32)
    g = jnp.asarray(rng.uniform(-3e38, 3e38, (2, 32, 32)), jnp.float32)
    d = jnp.full((2, 32), 0.9, jnp.float32)
    outs = [pallas_kernels.accumulate_rows(m, g, d, row_axis=row_axis, implementation=impl,
                                           interpret=impl == "pallas_triton")
            for impl in ("xla", "pallas_triton")]
    for a, b in zip(*outs):
        assert bool(jnp.all(jnp.isfinite(a))), row_axis
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(jnp.max(jnp.abs(outs[0][0]))) == SAT
