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
"""A float16 momentum's storage scale (``dion3_jax._storage``): the scale's arithmetic, the
bound the step keeps, and a float16 momentum that keeps its bits at gradient scales far outside
float16's range, against a float32 momentum."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dion3_jax
from dion3_jax import _storage


def _is_pow2(x: np.ndarray) -> np.ndarray:
    return (np.asarray(x, np.float32).view(np.uint32) & 0x7FFFFF) == 0


def test_write_scale_puts_the_bound_just_below_two_to_the_target():
    """For bounds drawn over 2⁻⁸⁹…2¹⁰⁰ (and exact powers of two), where the scale needs no
    clipping, it is a power of two with ``2^(TARGET−1) < scale·bound ≤ 2^TARGET`` (float64);
    beyond, it is clipped to ``2^±LIMIT``; 0, subnormal, ``inf`` and NaN bounds give 1."""
    rng = np.random.default_rng()
    bounds = np.concatenate([2.0 ** rng.uniform(-89, 100, 500),
                             2.0 ** rng.integers(-89, 100, 50)]).astype(np.float32)
    scale = np.asarray(jax.jit(_storage.write_scale)(jnp.asarray(bounds)), np.float64)
    assert np.all(_is_pow2(scale))
    product = scale * bounds.astype(np.float64)
    assert np.all(product <= 2.0 ** _storage.TARGET)
    assert np.all(product > 2.0 ** (_storage.TARGET - 1))
    edge = np.array([2.0 ** -120, 2.0 ** 120, 0.0, 1e-40, np.inf, np.nan], np.float32)
    np.testing.assert_array_equal(np.asarray(_storage.write_scale(jnp.asarray(edge))),
                                  [2.0 ** _storage.LIMIT, 2.0 ** -_storage.LIMIT, 1, 1, 1, 1])


def test_fold_unit_is_the_power_of_two_below_the_largest_factor():
    """``fold_unit(d)`` is ``2^⌊log2 max d⌋`` (float64 check): ``d/unit`` is below 2 and at
    least 1 for the largest factor; 1 when no factor is positive."""
    rng = np.random.default_rng()
    for _ in range(20):
        d = (rng.choice([0.9, 1.0], 16) * 2.0 ** rng.integers(-60, 60)).astype(np.float32)
        unit = float(_storage.fold_unit(jnp.asarray(d)))
        assert _is_pow2(np.float32(unit)) and 1 <= d.max() / unit < 2
    assert float(_storage.fold_unit(jnp.zeros(4))) == 1.0


@functools.cache
def _dion3(fraction: float, mu: float, mu_dtype=jnp.float32):
    """``scale_by_dion3(fraction, mu, mu_dtype=mu_dtype)`` and its jitted update: one compile
    per configuration and shapes, shared by the tests of this module."""
    tx = dion3_jax.scale_by_dion3(fraction, mu, mu_dtype=mu_dtype)
    return tx, jax.jit(tx.update)


def _momenta(scale: float, dtype, steps: int, fraction=1.0, mu=0.9, float32=True):
    """The states after ``steps`` steps of gradients ``scale·N(0, 1)`` (fresh draws) on a 48×64
    and a stacked 2×32×48 float32 matrix, with a float32 momentum (None without ``float32``)
    and one of ``dtype``, and the gradients."""
    rng = np.random.default_rng()
    shapes = {"w": (48, 64), "k": (2, 32, 48)}
    grads = [{k: jnp.asarray(scale * rng.standard_normal(s), jnp.float32)
              for k, s in shapes.items()} for _ in range(steps)]
    out = {jnp.float32: None}
    for mu_dtype in (jnp.float32, dtype) if float32 else (dtype,):
        tx, update = _dion3(fraction, mu, mu_dtype)
        state = tx.init(jax.tree.map(jnp.zeros_like, grads[0]))
        for g in grads:
            _, state = update(g, state)
        out[mu_dtype] = state
    return out[jnp.float32], out[dtype], grads


def _full(state) -> dict:
    return {k: np.asarray(state.momentum[k], np.float64)
            * np.asarray(state.momentum_scale[k], np.float64) for k in state.momentum}


@pytest.mark.slow  # the fast loop keeps test_transform's float16 range test
@pytest.mark.parametrize("log2_scale", [-40, -20, 0, 20])
def test_float16_momentum_keeps_its_bits_at_any_gradient_scale(log2_scale):
    """Gradients of ``2^k·N(0, 1)`` for ``k`` from −40 (far below float16's smallest
    subnormal) to 20 (past its largest value), f = 1, 12 steps: the float16 momentum, times its
    row factors, is the float32 momentum's within float16's rounding (one gap at the largest
    entry, 2⁻¹⁰ of it, per step), and its stored entries stay finite and below 65504."""
    f32, f16, _ = _momenta(2.0 ** log2_scale, jnp.float16, 12)
    want, got = _full(f32), _full(f16)
    for k in want:
        assert float(np.max(np.abs(np.asarray(f16.momentum[k], np.float64)))) < 65504
        top = np.max(np.abs(want[k]))
        assert top > 0
        np.testing.assert_allclose(got[k], want[k], rtol=0, atol=12 * 2.0 ** -10 * top)


def test_the_bound_is_the_largest_row_norm_and_sets_the_next_write():
    """f = 1 with μ = 0.5: every row decays, so the momentum is ``μ·S`` and the state's bound
    is ``S``'s largest row norm (float64, within float16 rounding); the row factors are ``μ``
    (or 1) over the write's scale, a power of two set by the step before's bound (at the first
    step, by the gradients' largest entry)."""
    f32, f16, grads = _momenta(3e-3, jnp.float16, 2, mu=0.5)
    full = _full(f32)
    tx, update = _dion3(1.0, 0.5, jnp.float16)
    first = update(grads[0], tx.init(jax.tree.map(jnp.zeros_like, grads[0])))[1]
    for k, m in full.items():
        rows = m / 0.5
        axes = tuple(range(rows.ndim - 1)) if k == "w" else (1,)   # (in, out): rows = out
        want = np.max(np.sqrt(np.sum(rows ** 2, axis=axes)))
        np.testing.assert_allclose(float(f16.momentum_bound[k]), want, rtol=2.0 ** -9)
        # the second write's scale came from the first step's bound
        scale = float(_storage.write_scale(first.momentum_bound[k]))
        d = np.asarray(f16.momentum_scale[k], np.float64) * scale
        assert set(np.unique(d)) <= {0.5, 1.0}, np.unique(d)
        first_scale = float(_storage.write_scale(jnp.max(jnp.abs(grads[0][k]))))
        d0 = np.asarray(first.momentum_scale[k], np.float64) * first_scale
        assert set(np.unique(d0)) <= {0.5, 1.0}, np.unique(d0)


def test_float32_and_bfloat16_momenta_carry_no_bound():
    """Only a float16 momentum has a storage scale: without one the state's bound is None."""
    params = {"w": jnp.zeros((8, 16))}
    for dtype, has in ((jnp.float32, False), (jnp.bfloat16, False), (jnp.float16, True)):
        state = dion3_jax.scale_by_dion3(0.5, mu_dtype=dtype).init(params)
        assert (state.momentum_bound is not None) == has, dtype


def test_a_float16_momentum_without_a_bound_is_refused_until_zeros_are_given():
    """A state whose float16 momentum has no ``momentum_bound`` (built by hand, or from before
    the field) raises a ``ValueError`` that names the leaf; with zeros in its place (no bound
    yet) the step writes unscaled, as the error says, and sets the bound: the momentum, times
    its row factors, matches a float32 momentum's within float16's rounding (float64)."""
    rng = np.random.default_rng()
    grads = [{"w": jnp.asarray(1e-2 * rng.standard_normal((24, 40)), jnp.float32)}
             for _ in range(3)]
    tx = dion3_jax.scale_by_dion3(1.0, 0.9, mu_dtype=jnp.float16)
    state = jax.jit(tx.update)(grads[0], tx.init(jax.tree.map(jnp.zeros_like, grads[0])))[1]
    with pytest.raises(ValueError, match=r"momentum\['w'\] is float16.*momentum_bound"):
        tx.update(grads[1], state._replace(momentum_bound=None))
    state = state._replace(momentum_bound={"w": jnp.zeros((), jnp.float32)})
    ref = dion3_jax.scale_by_dion3(1.0, 0.9)
    want = ref.init(jax.tree.map(jnp.zeros_like, grads[0]))
    for g in grads:
        want = jax.jit(ref.update)(g, want)[1]
    for g in grads[1:]:
        state = jax.jit(tx.update)(g, state)[1]
    assert float(state.momentum_bound["w"]) > 0
    top = float(np.max(np.abs(_full(want)["w"])))
    np.testing.assert_allclose(_full(state)["w"], _full(want)["w"], rtol=0,
                               atol=3 * 2.0 ** -10 * top)


@pytest.mark.slow  # the fast loop keeps test_transform's folded-scale test
def test_folding_a_float16_momentum_keeps_it_in_range():
    """``fold_momentum_scale`` of a float16 momentum stored with a scale of 2²⁰ and more
    (gradients ~1e-6): the folded momentum times its row factors (a power of two per leaf) is
    the unfolded one within one float16 rounding, its entries below 65504, and the optimizer
    continues from it as from the unfolded state (float16's rounding over one step; at f = 1,
    where that rounding cannot change which rows a near-tie selects)."""
    _, f16, grads = _momenta(1e-6, jnp.float16, 3, fraction=0.5, float32=False)
    folded = dion3_jax.fold_momentum_scale(f16)
    before, after = _full(f16), _full(folded)
    _, update = _dion3(1.0, 0.9, jnp.float16)
    for k in before:
        d = np.asarray(folded.momentum_scale[k])
        assert np.all(d == d.flat[0]) and _is_pow2(d.flat[0]) and d.flat[0] < 2.0 ** -20
        assert float(np.max(np.abs(np.asarray(folded.momentum[k], np.float64)))) < 65504
        np.testing.assert_allclose(after[k], before[k], rtol=2.0 ** -10,
                                   atol=2.0 ** -24 * d.flat[0])
    a = _full(update(grads[0], f16)[1])
    b = _full(update(grads[0], folded)[1])
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=0, atol=2.0 ** -9 * np.max(np.abs(a[k])))
