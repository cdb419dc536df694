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
"""``optax.inject_hyperparams(dion3_jax.dion3)`` as optax users write it.

optax injects every int, float and array argument (defaults included) as an array in the state.
``fraction`` fixes shapes, so its default is a ``fractions.Fraction``, which optax leaves alone:
``inject_hyperparams(dion3)(learning_rate=schedule)`` needs no ``static_args`` (it raised at
``init`` when the default was the float 0.25). Every numeric hyperparameter that can be traced
is injected, a change of one in the state takes effect without a recompile, and an injected
``fraction`` or ``num_heads`` is refused as static.
"""

from __future__ import annotations

from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dion3_jax
from test_compiles_once import counted_compiles

SEED = int(np.random.default_rng().integers(1 << 30))
#: Every injectable hyperparameter of dion3, given (mu and adam_learning_rate default to None,
#: which is not injected), and other values for each.
BASE = {"learning_rate": 0.01, "mu": 0.9, "beta2": 0.95, "weight_decay": 0.01,
        "adam_learning_rate": 1e-3, "adam_b1": 0.9, "adam_b2": 0.95, "adam_eps": 1e-8,
        "adam_weight_decay": 0.01}
OTHER = {"learning_rate": 0.03, "mu": 0.7, "beta2": 0.5, "weight_decay": 0.1,
         "adam_learning_rate": 3e-3, "adam_b1": 0.5, "adam_b2": 0.8, "adam_eps": 1e-3,
         "adam_weight_decay": 0.2}


def _problem(seed: int, steps: int):
    """Params (a matrix for Dion3, a bias for AdamW) and ``steps`` gradient trees."""
    rng = np.random.default_rng(seed)
    draw = lambda shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    params = {"w": draw((32, 16)), "bias": draw((16,))}
    return params, [jax.tree.map(lambda p: draw(p.shape), params) for _ in range(steps)]


def _run(update, state, params, grads):
    """The updates of each step, and the final state."""
    out = []
    for g in grads:
        u, state = update(g, state, params)
        out.append(u)
    return out, state


def _close(got, want):
    for a, b in zip(got, want):
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7), a, b)


@pytest.mark.parametrize("fraction", [
    None, pytest.param(Fraction(1, 2), marks=pytest.mark.slow)], ids=["default", "fraction"])
def test_schedule_needs_no_static_args_and_compiles_once(fraction):
    params, grads = _problem(SEED, 4)
    schedule = optax.linear_schedule(0.0, 0.1, 3)
    kw = {} if fraction is None else {"fraction": fraction}
    tx = optax.inject_hyperparams(dion3_jax.dion3)(learning_rate=schedule, **kw)
    state = tx.init(params)
    assert "fraction" not in state.hyperparams
    update = jax.jit(tx.update)
    first, state = _run(update, state, params, grads[:1])
    with counted_compiles() as seen:
        rest, _ = _run(update, state, params, grads[1:])
    assert seen == []
    plain = dion3_jax.dion3(schedule, **kw)
    want, _ = _run(jax.jit(plain.update), plain.init(params), params, grads)
    _close(first + rest, want)


def test_changing_the_injected_learning_rate_scales_the_update_exactly():
    params, (g,) = _problem(SEED + 1, 1)
    tx = optax.inject_hyperparams(dion3_jax.dion3)(learning_rate=0.01)
    update = jax.jit(tx.update)
    state = tx.init(params)
    base, _ = update(g, state, params)
    state.hyperparams["learning_rate"] = jnp.asarray(0.02, jnp.float32)   # its dtype: no retrace
    with counted_compiles() as seen:
        doubled, _ = update(g, state, params)
    assert seen == []
    for name in ("w", "bias"):   # both branches: Dion3 and AdamW (adam_learning_rate=None)
        np.testing.assert_array_equal(doubled[name], 2 * base[name])
        assert float(jnp.abs(base[name]).max()) > 0


@pytest.mark.slow
def test_every_injected_hyperparameter_takes_effect_without_a_recompile():
    """All of them changed in the state at once; the updates match an optimizer built with the
    new values (two steps: AdamW's b1, b2 and Dion3's mu act from the second on)."""
    params, grads = _problem(SEED + 2, 2)
    tx = optax.inject_hyperparams(dion3_jax.dion3)(**BASE)
    state = tx.init(params)
    assert set(state.hyperparams) == set(BASE)
    update = jax.jit(tx.update)
    _run(update, state, params, grads)                        # compiles
    for name, value in OTHER.items():
        state.hyperparams[name] = jnp.asarray(value, jnp.float32)
    with counted_compiles() as seen:
        got, _ = _run(update, state, params, grads)
    assert seen == []
    plain = dion3_jax.dion3(**OTHER)
    want, _ = _run(jax.jit(plain.update), plain.init(params), params, grads)
    _close(got, want)
    before = dion3_jax.dion3(**BASE)
    old, _ = _run(jax.jit(before.update), before.init(params), params, grads)
    for a, b in zip(got, old):   # the change did something, on both branches
        assert all(not np.allclose(a[k], b[k], rtol=1e-3) for k in ("w", "bias"))


@pytest.mark.slow
def test_static_args_still_work():
    """A float fraction in ``static_args``, as before; and a callable option (an
    ``Orthogonalizer`` record is callable), which optax takes for a schedule unless listed."""
    params, grads = _problem(SEED + 3, 1)
    polar = dion3_jax.make_orthogonalizer(backend="xla")
    tx = optax.inject_hyperparams(dion3_jax.dion3, static_args=("fraction", "orthogonalizer"))(
        learning_rate=0.01, fraction=0.5, orthogonalizer=polar)
    got, _ = _run(jax.jit(tx.update), tx.init(params), params, grads)
    plain = dion3_jax.dion3(0.01, 0.5, orthogonalizer=polar)
    want, _ = _run(jax.jit(plain.update), plain.init(params), params, grads)
    _close(got, want)


def test_injected_or_traced_fraction_and_num_heads_are_refused_as_static():
    params, _ = _problem(SEED + 4, 0)
    tx = optax.inject_hyperparams(dion3_jax.dion3)(learning_rate=0.01, fraction=0.5)
    with pytest.raises(ValueError, match=r"fraction is static.*static_args=\('fraction',\)"):
        tx.init(params)
    with pytest.raises(ValueError, match="fraction is static"):
        jax.jit(lambda f: dion3_jax.scale_by_dion3(f).init({"w": params["w"]}))(0.5)
    tx = optax.inject_hyperparams(dion3_jax.dion3)(learning_rate=0.01, num_heads=2)
    with pytest.raises(ValueError, match=r"num_heads is static.*static_args=\('num_heads',\)"):
        tx.init(params)
    tx = optax.inject_hyperparams(dion3_jax.dion3, static_args=("num_heads",))(
        learning_rate=0.01, num_heads=2)
    assert tx.init(params).inner_state.inner_states["dion3"].inner_state[0].count == 0
