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
"""``dion3_jax.apply_if_finite``: optax's rule and state, with zeros in the inner updates' dtypes,
so that it guards Dion3 with 16-bit parameters (whose matrices get float32 updates)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dion3_jax
from seeds import module_seed

#: Fresh random inputs per run, printed with every test (tests/seeds.py).
SEED = module_seed()

SHAPES = {"w": (32, 64), "b": (64,)}


def _params(rng, dtype):
    return {k: jnp.asarray(rng.standard_normal(s) * 0.5, dtype) for k, s in SHAPES.items()}


def _grads(rng, dtype, fill=None):
    g = {k: rng.standard_normal(s) * 0.3 for k, s in SHAPES.items()}
    if fill is not None:   # one non-finite entry in the matrix
        g["w"][rng.integers(SHAPES["w"][0]), rng.integers(SHAPES["w"][1])] = fill
    return {k: jnp.asarray(v, dtype) for k, v in g.items()}


def _bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_16bit_steps_are_skipped_with_float32_zeros_and_the_state_kept(dtype):
    """With 16-bit parameters the guarded Dion3 skips NaN and inf steps (zero updates in the inner
    updates' dtypes: float32 for the matrix, the parameter's dtype for the AdamW leaf; the inner
    state bitwise unchanged), gives up after ``max_consecutive_errors`` in a row, and applies
    every finite step exactly as the unguarded optimizer does."""
    rng = np.random.default_rng(SEED)
    params = _params(rng, dtype)
    plain = dion3_jax.dion3(0.02, 0.25)
    guarded = dion3_jax.apply_if_finite(plain, max_consecutive_errors=1)
    step, plain_step = jax.jit(guarded.update), jax.jit(plain.update)
    state, plain_state = guarded.init(params), plain.init(params)
    seq = [("ok", None), ("skip", np.nan), ("ok", None), ("skip", np.inf), ("apply", np.nan),
           ("ok", None)]
    for i, (what, fill) in enumerate(seq):
        g = _grads(rng, dtype, fill)
        before = _bits(state.inner_state)
        u, state = step(g, state, params)
        assert u["w"].dtype == jnp.float32 and u["b"].dtype == dtype, i
        assert int(state.notfinite_count) == {"ok": 0, "skip": 1, "apply": 2}[what], i
        assert bool(state.last_finite) == (what == "ok"), i
        if what == "skip":
            assert _bits(state.inner_state) == before, i
            assert not any(np.any(np.asarray(x, np.float32)) for x in jax.tree.leaves(u)), i
            continue
        want, plain_state = plain_step(g, plain_state, params)
        assert _bits(u) == _bits(want) and _bits(state.inner_state) == _bits(plain_state), i
        if what == "ok":
            params = optax.apply_updates(params, u)
    assert int(state.total_notfinite) == 3
    assert step._cache_size() == 1


def test_float32_matches_optax_apply_if_finite_bitwise():
    """For float32 parameters it is ``optax.apply_if_finite``: the same updates and states."""
    rng = np.random.default_rng(SEED)
    params = _params(rng, jnp.float32)
    ours = dion3_jax.apply_if_finite(dion3_jax.dion3(0.02, 0.5), 2)
    theirs = optax.apply_if_finite(dion3_jax.dion3(0.02, 0.5), 2)
    s1, s2 = ours.init(params), theirs.init(params)
    for fill in (None, np.nan, -np.inf, np.nan, None, np.inf):
        g = _grads(rng, jnp.float32, fill)
        u1, s1 = jax.jit(ours.update)(g, s1, params)
        u2, s2 = jax.jit(theirs.update)(g, s2, params)
        assert _bits(u1) == _bits(u2) and _bits(s1) == _bits(s2), fill
    assert int(s1.total_notfinite) == 4


def test_traces_the_inner_update_once():
    """The skipped step's dtypes come from the one trace of the inner update that ``lax.cond``
    makes, not from a second trace."""
    inner, calls = dion3_jax.dion3(0.02, 0.25), []

    def update(updates, state, params=None):
        calls.append(1)
        return inner.update(updates, state, params)

    rng = np.random.default_rng(SEED)
    params = _params(rng, jnp.bfloat16)
    tx = dion3_jax.apply_if_finite(optax.GradientTransformation(inner.init, update), 1)
    u, _ = jax.jit(tx.update)(_grads(rng, jnp.bfloat16, np.nan), tx.init(params), params)
    assert len(calls) == 1 and u["w"].dtype == jnp.float32


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3", None])
def test_refuses_a_bad_max_consecutive_errors(bad):
    with pytest.raises(ValueError, match=f"max_consecutive_errors={bad!r}"):
        dion3_jax.apply_if_finite(dion3_jax.dion3(0.02), bad)
