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
"""scale_by_dion3 / dion3 against the float64 NumPy rendering of the update rule
(tests/dion3_reference.py; docs/ARCHITECTURE.md states the rule)."""

from __future__ import annotations

import contextlib
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dion3_jax
from dion3_jax import DimensionNumbers, _selection
import dion3_reference as ref
from platform_setup import committed
from seeds import module_seed

STEPS = 3
#: Every run draws fresh inputs (``np.random.default_rng(SEED + i)``; the seed is printed with
#: each test by ``conftest.print_module_seed``).
SEED = module_seed()


def f64_polar():
    return dion3_jax.make_orthogonalizer(compute_dtype=jnp.float64)  # under enable_x64


# --- leaf <-> (out × in) matrices, written independently of dion3_jax._layout -----------------

def leaf_to_mats(w, kind, num_heads=None, splits=None):
    """Returns a list of (n_i × C) float64 matrices of one leaf."""
    w = np.asarray(w, np.float64)
    if kind == "flax":          # (in, out)
        full = [w.T]
    elif kind == "torch":       # (out, in)
        full = [w]
    elif kind == "stacked":     # (L, in, out)
        full = [w[l].T for l in range(w.shape[0])]
    elif kind == "conv":        # (kh, kw, in, out) with reduction axes (0, 1, 2)
        full = [w.reshape(-1, w.shape[-1]).T]
    else:
        raise AssertionError(kind)
    mats = []
    for m in full:
        if num_heads:
            hd = m.shape[0] // num_heads
            mats += [m[h * hd:(h + 1) * hd] for h in range(num_heads)]
        elif splits:
            o = np.cumsum([0, *splits])
            mats += [m[o[i]:o[i + 1]] for i in range(len(splits))]
        else:
            mats.append(m)
    return mats


def mats_to_leaf(mats, shape, kind, num_heads=None, splits=None):
    per_full = (num_heads or (len(splits) if splits else 1))
    fulls = [np.concatenate(mats[i:i + per_full], axis=0) for i in range(0, len(mats), per_full)]
    if kind == "flax":
        return fulls[0].T
    if kind == "torch":
        return fulls[0]
    if kind == "stacked":
        return np.stack([m.T for m in fulls])
    if kind == "conv":
        return fulls[0].T.reshape(shape)
    raise AssertionError(kind)


DN = {"flax": None, "torch": DimensionNumbers(reduction_axis=1, output_axis=0),
      "stacked": None, "conv": DimensionNumbers(reduction_axis=(0, 1, 2), output_axis=3)}

CASES = [
    # name, kind, shape, fraction, extra options
    ("wide", "flax", (48, 20), 0.25, {}),
    ("tall", "flax", (16, 40), 0.25, {}),
    ("square", "flax", (24, 24), 0.5, {}),
    ("odd_sizes", "flax", (37, 23), 0.3, {}),
    ("k_rounding_0.07x100", "flax", (30, 100), 0.07, {}),
    ("torch_layout", "torch", (20, 48), 0.25, {}),
    ("stacked_3d", "stacked", (3, 32, 12), 0.25, {}),
    ("conv_4d", "conv", (3, 3, 4, 10), 0.4, {}),
    ("num_heads", "flax", (32, 24), 0.25, {"num_heads": 3}),
    ("split_sizes_gqa", "flax", (32, 40), 0.25, {"split_sizes": (24, 8, 8)}),
    ("muon_flavor", "flax", (40, 24), 0.25, {"flavor": "muon"}),
    ("rms_norm", "flax", (40, 24), 0.25, {"adjust_lr": "rms_norm"}),
    ("adjust_none", "flax", (40, 24), 0.25, {"adjust_lr": None}),
    ("fraction_one", "flax", (40, 24), 1.0, {}),
    ("torch_heads", "torch", (24, 16), 0.5, {"num_heads": 2}),
]


def _reference_run(w0, grads, kind, f, *, lr, mu, beta2, wd, flavor, adjust, num_heads, splits):
    mats = leaf_to_mats(w0, kind, num_heads, splits)
    ms = [np.zeros_like(m) for m in mats]
    vs = [np.zeros(m.shape[0]) for m in mats]
    for g in grads:
        gm = leaf_to_mats(g, kind, num_heads, splits)
        for i in range(len(mats)):
            mats[i], ms[i], vs[i] = ref.dion3_matrix_step(
                mats[i], gm[i], ms[i], vs[i], lr=lr, f=f, mu=mu, beta2=beta2, wd=wd,
                flavor=flavor, adjust=adjust)
    return mats_to_leaf(mats, w0.shape, kind, num_heads, splits), ms, vs


# With the slow tests only: what the fast loop checks elsewhere (f = 1 and the Muon flavor:
# test_fraction_one_is_muon_momentum; torch layout and heads: their own cases here, and their
# composition in tests/test_layout.py).
SLOW_CASES = {"fraction_one", "muon_flavor", "torch_heads"}


@pytest.mark.parametrize("name,kind,shape,f,opts", [
    pytest.param(*c, id=c[0], marks=[pytest.mark.slow] if c[0] in SLOW_CASES else [])
    for c in CASES])
def test_matches_float64_reference(name, kind, shape, f, opts):
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    lr, mu, beta2, wd = 0.05, 0.9, 0.8, 0.1
    flavor = opts.get("flavor", "normuon")
    adjust = opts.get("adjust_lr", "spectral_norm")
    num_heads, splits = opts.get("num_heads"), opts.get("split_sizes")
    w0 = rng.standard_normal(shape)
    grads = [rng.standard_normal(shape) for _ in range(STEPS)]
    want, _, _ = _reference_run(w0, grads, kind, f, lr=lr, mu=mu, beta2=beta2, wd=wd,
                                flavor=flavor, adjust=adjust, num_heads=num_heads,
                                splits=splits)
    with jax.enable_x64(True):
        tx = dion3_jax.dion3(
            lr, f, mu, beta2, wd, flavor=flavor, adjust_lr=adjust,
            dimension_numbers=DN[kind], num_heads=num_heads, split_sizes=splits,
            orthogonalizer=f64_polar(),
            param_labels=lambda p: jax.tree.map(lambda _: "dion3", p))
        params = committed({"w": jnp.asarray(w0)})
        state = tx.init(params)
        step = jax.jit(tx.update)
        for g in grads:
            upd, state = step({"w": jnp.asarray(g)}, state, params)
            params = optax.apply_updates(params, upd)
        got = np.asarray(params["w"])
    assert got.dtype == np.float64
    # The NorMuon normalization runs in float32 by design, hence ~1e-6 relative.
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    assert not np.allclose(got, w0)


def test_default_precision_close_to_reference():
    """Default (float16 Gram NS, float32 params) agrees with the float64 rule at fp16 tolerance."""
    rng = np.random.default_rng(SEED + 0)
    shape, f = (64, 48), 0.25
    w0 = rng.standard_normal(shape).astype(np.float32)
    grads = [rng.standard_normal(shape).astype(np.float32) for _ in range(STEPS)]
    want, _, _ = _reference_run(w0, grads, "flax", f, lr=0.02, mu=0.95 ** (1 / f), beta2=0.95,
                                wd=0.01, flavor="normuon", adjust="spectral_norm",
                                num_heads=None, splits=None)
    tx = dion3_jax.dion3(0.02, f)    # default mu: 0.95^(1/f)
    params = committed({"w": jnp.asarray(w0)})
    state = tx.init(params)
    for g in grads:
        upd, state = jax.jit(tx.update)({"w": jnp.asarray(g)}, state, params)
        params = optax.apply_updates(params, upd)
    delta_got = np.asarray(params["w"]) - w0
    delta_want = want - w0
    rel = np.linalg.norm(delta_got - delta_want) / np.linalg.norm(delta_want)
    assert rel < 2e-2, rel


def test_k_rule():
    assert _selection.num_selected(0.07, 100) == 8
    assert _selection.num_selected(0.25, 10) == 3
    assert _selection.num_selected(1e-6, 10) == 1
    assert _selection.num_selected(1, 7) == 7


def test_only_selected_rows_move_and_decay():
    rng = np.random.default_rng(SEED + 1)
    n, c, f, mu = 40, 16, 0.25, 0.5
    g = rng.standard_normal((c, n)).astype(np.float32)   # flax (in, out): rows are columns
    tx = dion3_jax.scale_by_dion3(f, mu)
    state = tx.init({"w": jnp.zeros((c, n))})
    upd, state = jax.jit(tx.update)({"w": jnp.asarray(g)}, state)
    upd = np.asarray(upd["w"])
    moved = np.flatnonzero(np.abs(upd).sum(axis=0) > 0)
    k = _selection.num_selected(f, n)
    expected = np.sort(np.argsort(-np.abs(g).sum(axis=0))[:k])
    np.testing.assert_array_equal(moved, expected)
    mom = np.asarray(state.full_momentum()["w"])
    np.testing.assert_allclose(mom[:, expected], mu * g[:, expected], rtol=1e-6)
    rest = np.setdiff1d(np.arange(n), expected)
    np.testing.assert_array_equal(mom[:, rest], g[:, rest])
    # Stored as (S, d): S = M + G everywhere, the decay μ in the selected rows' factors.
    np.testing.assert_array_equal(np.asarray(state.momentum["w"]), g)
    scale = np.asarray(state.momentum_scale["w"])
    assert scale.shape == (1, n) and scale.dtype == np.float32
    np.testing.assert_array_equal(scale[0, expected], np.float32(mu))
    np.testing.assert_array_equal(scale[0, rest], 1.0)
    var = np.asarray(state.variance["w"])
    assert var.shape == (1, n)
    assert np.all(var[0, expected] > 0) and np.all(var[0, rest] == 0)


@pytest.mark.parametrize("flavor", ["muon", "normuon"])
def test_fraction_one_is_muon_momentum(flavor):
    """At f = 1 the rule is Muon / NorMuon with U_t = μ·U_{t−1} + G_t, written here directly."""
    rng = np.random.default_rng(SEED + 2)
    shape, lr, mu, beta2, wd = (24, 40), 0.03, 0.9, 0.9, 0.05
    w0 = rng.standard_normal(shape)
    grads = [rng.standard_normal(shape) for _ in range(4)]
    w, u, v = w0.T.copy(), np.zeros(shape[::-1]), np.zeros(shape[1])
    for g in grads:
        u = mu * u + g.T
        o = ref.ns_polar(u)
        if flavor == "normuon":
            v = beta2 * v + (1 - beta2) * (o**2).mean(axis=1)
            d = o / (np.sqrt(v)[:, None] + 1e-8)
            o = d * np.linalg.norm(o) / np.linalg.norm(d)
        w = w * (1 - lr * wd) - lr * np.sqrt(shape[1] / shape[0]) * o
    make = dion3_jax.muon if flavor == "muon" else dion3_jax.normuon
    with jax.enable_x64(True):
        kw = {"beta2": beta2} if flavor == "normuon" else {}
        tx = make(lr, mu=mu, weight_decay=wd, orthogonalizer=f64_polar(), **kw)
        params = committed({"w": jnp.asarray(w0)})
        state = tx.init(params)
        for g in grads:
            upd, state = jax.jit(tx.update)({"w": jnp.asarray(g)}, state, params)
            params = optax.apply_updates(params, upd)
    np.testing.assert_allclose(np.asarray(params["w"]), w.T, rtol=2e-5, atol=2e-6)


@pytest.mark.slow
def test_state_stable_and_no_recompile():
    params = committed({"a": jnp.ones((32, 16)), "m": jnp.ones((16, 48), jnp.bfloat16),
                        "s": jnp.ones((2, 8, 12)), "bias": jnp.zeros((16,), jnp.bfloat16)})
    tx = dion3_jax.dion3(0.01, 0.25, dimension_numbers=DimensionNumbers(-2, -1))  # "s": 2 matrices
    state = tx.init(params)
    traces = []

    @jax.jit
    def step(g, s, p):
        traces.append(1)
        return tx.update(g, s, p)

    g = jax.tree.map(lambda x: jnp.full(x.shape, 0.5, x.dtype), params)
    upd, state2 = step(g, state, params)
    _, state3 = step(g, state2, params)
    assert len(traces) == 1
    spec = lambda t: jax.tree.map(lambda x: (x.shape, x.dtype), t)
    assert spec(state) == spec(state2) == spec(state3)
    # a bfloat16 matrix's update is float32 (one rounding in apply_updates); AdamW's keeps its
    # leaf's dtype
    assert upd["m"].dtype == upd["a"].dtype == jnp.float32 and upd["bias"].dtype == jnp.bfloat16


def test_bfloat16_params_stay_bfloat16():
    rng = np.random.default_rng(SEED + 3)
    params = {"w": jnp.asarray(rng.standard_normal((32, 64)), jnp.bfloat16)}
    tx = dion3_jax.dion3(0.02, 0.5)
    state = tx.init(params)
    g = {"w": jnp.asarray(rng.standard_normal((32, 64)), jnp.bfloat16)}
    upd, state = jax.jit(tx.update)(g, state, params)
    new = optax.apply_updates(params, upd)
    assert new["w"].dtype == jnp.bfloat16
    assert upd["w"].dtype == jnp.float32        # rounded once, by apply_updates
    assert bool(jnp.all(jnp.isfinite(new["w"].astype(jnp.float32))))
    inner = state.inner_states["dion3"].inner_state[0]
    assert inner.momentum["w"].dtype == jnp.float16     # the 16-bit default: float16 momentum
    assert inner.momentum_bound is not None
    assert inner.variance["w"].dtype == jnp.float32
    tx16 = dion3_jax.dion3(0.02, 0.5, mu_dtype=jnp.bfloat16)
    assert tx16.init(params).inner_states["dion3"].inner_state[0].momentum["w"].dtype == \
        jnp.bfloat16


def test_float16_momentum_is_stored_within_its_range():
    """float16 parameters, f = 1 and μ = 0.99: the momentum sums gradients of 3000–6000 past
    65504 (float16's largest) within 40 steps. A float16 momentum is stored in units of a power
    of two (``dion3_jax._storage``): its entries stay below 65504 and ``momentum ×
    momentum_scale`` is the float32 momentum's within float16's rounding (40 steps of at most
    one float16 gap each at the largest entry, 2⁻¹⁰ of it), on fresh random gradients. The
    default momentum of float16 parameters is this float16 one; for float32 parameters it is
    the parameter's dtype."""
    params = {"w": jnp.zeros((16, 64), jnp.float16)}
    rng = np.random.default_rng()
    grads = [{"w": jnp.asarray(3000 * (1 + rng.random((16, 64))), jnp.float16)}
             for _ in range(40)]
    full = {}
    for mu_dtype in (jnp.float32, None):
        tx = dion3_jax.scale_by_dion3(1, mu=0.99, mu_dtype=mu_dtype)
        state = tx.init(params)
        for g in grads:
            u, state = jax.jit(tx.update)(g, state)
        assert u["w"].dtype == jnp.float32
        m = state.momentum["w"]
        assert m.dtype == (jnp.float32 if mu_dtype else jnp.float16)
        assert bool(jnp.all(jnp.isfinite(m))) and bool(jnp.all(jnp.isfinite(u["w"]))), mu_dtype
        if mu_dtype is None:
            assert float(jnp.max(jnp.abs(m.astype(jnp.float32)))) < 65504.0
        full[mu_dtype] = np.asarray(m, np.float64) * np.asarray(state.momentum_scale["w"])
    assert np.max(full[jnp.float32]) > 65504.0
    np.testing.assert_allclose(full[None], full[jnp.float32], rtol=0,
                               atol=40 * 2.0 ** -10 * np.max(np.abs(full[jnp.float32])))
    assert dion3_jax.scale_by_dion3().init({"w": jnp.zeros((4, 8))}).momentum["w"].dtype == \
        jnp.float32


@pytest.mark.parametrize("kwargs,name", [
    ({"fraction": 0.0}, "fraction"),
    ({"fraction": 1.5}, "fraction"),
    ({"mu": -0.1}, "mu"),
    ({"mu": 1.5}, "mu"),
    ({"beta2": 1.0}, "beta2"),
    ({"beta2": -0.5}, "beta2"),
    ({"flavor": "adam"}, "flavor"),
    ({"adjust_lr": "spectral"}, "adjust_lr"),
    ({"num_heads": 0}, "num_heads"),
    ({"num_heads": "4"}, "num_heads"),
    ({"num_heads": True}, "num_heads"),
    ({"split_sizes": (4,)}, "split_sizes"),
    ({"split_sizes": (4, -1)}, "split_sizes"),
    ({"split_sizes": (4, 4), "num_heads": 2}, "num_heads and split_sizes"),
    ({"weight_decay": -1.0}, "weight_decay"),
    ({"weight_decay": float("inf")}, "weight_decay"),
    ({"learning_rate": -1.0}, "learning_rate"),
    ({"learning_rate": float("inf")}, "learning_rate"),
    ({"learning_rate": float("nan")}, "learning_rate"),
    ({"scalar_optimizer": "sgd"}, "scalar_optimizer"),
    ({"adam_b1": 1.0}, "adam_b1"),
    ({"adam_b2": -0.1}, "adam_b2"),
    ({"adam_eps": -1e-8}, "adam_eps"),
    ({"adam_learning_rate": -1e-3}, "adam_learning_rate"),
    ({"mu_dtype": jnp.int32}, "mu_dtype"),
    ({"mu_dtype": "not-a-dtype"}, "mu_dtype"),
    ({"dimension_numbers": "flax"}, "dimension_numbers"),
    ({"dimension_numbers": 3}, "dimension_numbers"),
])
def test_invalid_hyperparameters_raise_at_construction(kwargs, name):
    kwargs = {"learning_rate": 0.01, **kwargs}
    with pytest.raises(ValueError, match=name):
        dion3_jax.dion3(**kwargs)


@pytest.mark.parametrize("name", ["mu", "beta2", "adam_b1", "adam_b2", "adam_eps"])
def test_schedules_are_refused_where_unsupported(name):
    """``mu``, ``beta2`` and the scalar optimizer's moments take no schedule: a callable raises a
    ValueError naming the argument and the value at construction (it used to pass the checks
    and fail inside the step)."""
    def schedule(count):
        return 0.9

    with pytest.raises(ValueError, match=f"{name} must be a number.*{name}=<function"):
        dion3_jax.dion3(0.01, **{name: schedule})
    if name in ("mu", "beta2"):
        with pytest.raises(ValueError, match=name):
            dion3_jax.scale_by_dion3(**{name: schedule})
    with pytest.raises(ValueError, match="mu_full"):
        dion3_jax.momentum_for_fraction(0.5, schedule)


def test_schedules_still_accepted_for_learning_rates_and_weight_decay():
    sched = optax.linear_schedule(0.02, 0.0, 10)
    tx = dion3_jax.dion3(sched, weight_decay=sched, adam_learning_rate=sched,
                         adam_weight_decay=sched)
    params = {"w": jnp.ones((16, 16)), "b": jnp.zeros((16,))}
    u, _ = jax.jit(tx.update)(params, tx.init(params), params)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(u))


# Each case compiles a step. The fast loop keeps the two fractions that used to be refused
# and the options that take another path (ints, tuples, dataclasses); the other float
# hyperparameters go through the same check (``_numbers.is_real``) with the slow tests, all
# in one step.
_SCALAR = pytest.mark.slow


@pytest.mark.parametrize("kwargs", [
    {"fraction": np.float32(0.25)}, {"fraction": np.int64(1)},
    pytest.param({"fraction": np.float16(0.5), "mu": np.float32(0.9),
                  "beta2": np.float32(0.9), "learning_rate": np.float32(0.01),
                  "weight_decay": np.float64(0.1), "adam_b1": np.float32(0.9),
                  "adam_eps": np.float32(1e-8)}, marks=_SCALAR),
    pytest.param({"fraction": np.float64(0.25)}, marks=_SCALAR),
    {"num_heads": np.int64(2)}, {"split_sizes": (np.int64(8), np.int32(8))},
    {"dimension_numbers": DimensionNumbers(np.int64(0), np.int32(1))},
    {"mesh_options": dion3_jax.MeshOptions(seed=np.int64(3))},
    {"orthogonalizer": {"restarts": (np.int64(2),), "steps": np.int64(5)}},
])
def test_numpy_scalars_are_accepted_like_python_numbers(kwargs):
    """NumPy scalars work wherever Python numbers do (``np.float32(0.25)`` and ``np.int64(1)``
    used to be refused while ``np.float64(0.25)``, a float subclass, passed)."""
    if "orthogonalizer" in kwargs:
        kwargs = {"orthogonalizer": dion3_jax.make_orthogonalizer(**kwargs["orthogonalizer"])}
    tx = dion3_jax.dion3(**{"learning_rate": 0.01, **kwargs})
    params = {"w": jnp.ones((16, 16))}
    u, _ = jax.jit(tx.update)(params, tx.init(params), params)
    assert bool(jnp.all(jnp.isfinite(u["w"])))


@pytest.mark.parametrize("kwargs,text", [
    ({"fraction": np.float32(1.5)}, "fraction=np.float32(1.5)"),
    ({"fraction": np.int64(0)}, "fraction=np.int64(0)"),
    ({"mu": np.float32(1.5)}, "mu=np.float32(1.5)"),
    ({"beta2": np.float64(1.0)}, "beta2=np.float64(1.0)"),
    ({"num_heads": np.int64(0)}, "num_heads=np.int64(0)"),
    ({"num_heads": np.True_}, "num_heads=np.True_"),
    ({"split_sizes": (np.int64(4), np.int64(-1))}, "split_sizes"),
])
def test_bad_numpy_scalars_raise_value_errors_naming_them(kwargs, text):
    with pytest.raises(ValueError, match=re.escape(text)):
        dion3_jax.dion3(**{"learning_rate": 0.01, **kwargs})


@pytest.mark.parametrize("kwargs,name", [
    ({"learning_rate": None}, "learning_rate"),
    ({"learning_rate": "0.02"}, "learning_rate"),
    ({"weight_decay": None}, "weight_decay"),
    ({"fraction": True}, "fraction"),
    ({"fraction": "0.25"}, "fraction"),
    ({"fraction": "a"}, "fraction"),
    ({"mu": "0.9"}, "mu"),
    ({"orthogonalizer": 3}, "orthogonalizer"),
    ({"mesh_options": {"shard_axis": "x"}}, "mesh_options"),
])
def test_wrong_types_raise_type_error_naming_the_argument(kwargs, name):
    kwargs = {"learning_rate": 0.01, **kwargs}
    with pytest.raises(TypeError, match=name):
        dion3_jax.dion3(**kwargs)


@pytest.mark.parametrize("kwargs,name", [
    ({"method": "svd"}, "method"),
    ({"backend": "cuda"}, "backend"),
    ({"restarts": (0,)}, "restarts"),
    ({"restarts": (5,)}, "restarts"),
    ({"restarts": 2}, "restarts"),
    ({"coefficients": "muon"}, "coefficients"),
    ({"coefficients": [(1.0, 2.0)]}, "coefficients"),
    ({"compute_dtype": jnp.int32}, "compute_dtype"),
])
def test_invalid_polar_options_raise_at_construction(kwargs, name):
    with pytest.raises(ValueError, match=name):
        dion3_jax.make_orthogonalizer(**kwargs)


def test_an_unknown_polar_option_is_a_type_error():
    """``make_orthogonalizer`` writes out ``polar``'s options: another name is a call error."""
    with pytest.raises(TypeError, match="ns_steps"):
        dion3_jax.make_orthogonalizer(ns_steps=5)


@pytest.mark.parametrize("shape,opts,match", [
    ((10, 12), {"num_heads": 5}, "num_heads"),
    ((10, 12), {"split_sizes": (4, 4)}, "split_sizes"),
    ((10,), {}, "rank < 2"),
    ((10, 12), {"dimension_numbers": DimensionNumbers(0, 0)}, "overlap"),
    ((10, 12), {"dimension_numbers": DimensionNumbers(0, 2)}, "out of range"),
])
def test_leaf_errors_at_init_name_the_leaf(shape, opts, match):
    tx = dion3_jax.scale_by_dion3(**opts)
    with pytest.raises(ValueError, match=match) as e:
        tx.init({"layer": {"kernel": jnp.zeros(shape)}})
    assert "kernel" in str(e.value) or "num_heads" in str(e.value)


@pytest.mark.slow
def test_nonfinite_gradient_is_detectable_and_skippable():
    """A NaN gradient makes the update non-finite (detectable); optax.apply_if_finite skips it
    and leaves the Dion3 state bit-for-bit unchanged, so training continues unpoisoned."""
    rng = np.random.default_rng(SEED + 4)
    params = committed({"w": jnp.asarray(rng.standard_normal((16, 24)), jnp.float32),
                        "b": jnp.zeros((24,))})
    good = [jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), params)
            for _ in range(2)]
    bad = jax.tree.map(lambda x: x, good[0])
    bad["w"] = bad["w"].at[3, 5].set(jnp.nan)

    plain = dion3_jax.dion3(0.02, 0.5)
    upd, _ = jax.jit(plain.update)(bad, plain.init(params), params)
    assert not bool(jnp.all(jnp.isfinite(upd["w"])))

    tx = optax.apply_if_finite(dion3_jax.dion3(0.02, 0.5), max_consecutive_errors=3)
    step = jax.jit(tx.update)
    s0 = committed(tx.init(params))
    u1, s1 = step(good[0], s0, params)
    p1 = optax.apply_updates(params, u1)
    u_bad, s_bad = step(bad, s1, p1)
    assert int(s_bad.notfinite_count) == 1
    assert all(bool(jnp.all(x == 0)) for x in jax.tree.leaves(u_bad))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 s1.inner_state, s_bad.inner_state)
    # continuing after the skipped step equals never having seen it
    u2, _ = step(good[1], s_bad, p1)
    u2_ref, _ = step(good[1], s1, p1)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 u2, u2_ref)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(u2))


@pytest.mark.slow
def test_custom_orthogonalizer_gets_batches():
    seen = []

    def ortho(x):
        seen.append(x.shape)
        return dion3_jax.polar(x)

    params = {"a": jnp.ones((16, 32)), "b": jnp.ones((16, 32)), "c": jnp.ones((8, 32))}
    rng = np.random.default_rng(SEED + 0)
    g = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape, np.float32)), params)
    tx = dion3_jax.scale_by_dion3(0.25, orthogonalizer=ortho)
    jax.jit(tx.update)(g, tx.init(params))
    # a and b (same shape) share one call: selected 8 rows of 16 inputs → (2, 8, 16) wide
    assert sorted(seen) == sorted([(2, 8, 16), (1, 8, 8)])


@pytest.mark.slow
def test_default_orthogonalizer_returns_the_compute_dtype_same_update():
    """scale_by_dion3 takes the polar factors in the compute dtype (no float32 copy); for float32
    parameters the update is bitwise the one with factors cast to float32 by the polar."""
    rng = np.random.default_rng(SEED)
    params = {"a": jnp.asarray(rng.standard_normal((16, 40)), jnp.float32),
              "b": jnp.asarray(rng.standard_normal((40, 16)), jnp.float32)}
    grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype), params)
    ours = dion3_jax.scale_by_dion3(0.5)
    f32_out = dion3_jax.scale_by_dion3(
        0.5, orthogonalizer=dion3_jax.make_orthogonalizer(method="gram", backend="xla"))
    u1, _ = jax.jit(ours.update)(grads, ours.init(params))
    u2, _ = jax.jit(f32_out.update)(grads, f32_out.init(params))
    for k in params:
        assert u1[k].dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(u1[k]), np.asarray(u2[k]), err_msg=k)


@pytest.mark.slow
@pytest.mark.parametrize("fraction", [1.0, 0.25])
def test_huge_finite_gradients_give_the_unscaled_update(fraction):
    """Gradients ×2⁶⁶ (≈ 7e19) square to inf in float32; the update must still be the ×1 one
    (the polar and NorMuon are scale-invariant), not silently zero. A power of two keeps every
    rounding of the two runs the same, so the tolerance is tight; two steps, fresh inputs."""
    rng = np.random.default_rng(SEED)
    shapes = {"a": (24, 40), "b": (24, 40), "c": (40, 24), "heads": (16, 32)}
    params = {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in shapes.items()}
    grads = [{k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
             for _ in range(2)]
    tx = dion3_jax.scale_by_dion3(fraction, num_heads={"heads": 2})
    out = {}
    for scale in (1.0, 2.0 ** 66):
        state, out[scale] = tx.init(params), []
        for g in grads:
            u, state = jax.jit(tx.update)(jax.tree.map(lambda x: jnp.asarray(x * scale), g),
                                          state)
            out[scale].append(u)
    for step, (u1, u20) in enumerate(zip(out[1.0], out[2.0 ** 66])):
        for k in shapes:
            big = np.asarray(u20[k])
            assert np.all(np.isfinite(big)) and np.abs(big).max() > 0.1, (step, k)
            np.testing.assert_allclose(big, np.asarray(u1[k]), rtol=0, atol=1e-6,
                                       err_msg=f"step {step} {k}")


@pytest.mark.slow
@pytest.mark.parametrize("with_mesh", [False, True])
def test_jitted_update_compiles_once(with_mesh):
    """init's state (every leaf committed, the scalar branch's count too) and update's output
    state hit the same compiled update."""
    params = {"w": jnp.ones((16, 32)), "v": jnp.ones((32, 16)), "b": jnp.zeros((16,))}
    tx = dion3_jax.dion3(0.02, 0.5)
    grad = jax.jit(lambda p: jax.tree.map(lambda x: x * 0.1 + 1.0, p))
    mesh = jax.make_mesh((2,), ("fsdp",), devices=jax.devices()[:2])
    ctx = jax.set_mesh(mesh) if with_mesh else contextlib.nullcontext()
    params = {k: jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.P(*[None] * x.ndim))
                                if with_mesh else jax.devices()[0]) for k, x in params.items()}
    with ctx:
        state = tx.init(params)
        update = jax.jit(tx.update)
        for _ in range(3):
            u, state = update(grad(params), state, params)
            params = optax.apply_updates(params, u)
        assert update._cache_size() == 1


def test_python_scalar_leaves_are_scalars_as_in_adamw():
    params = {"w": jnp.ones((8, 16)), "t": 1.0}
    tx = dion3_jax.dion3(0.02, 0.5, adam_learning_rate=0.1)
    state = tx.init(params)
    grads = {"w": jnp.full((8, 16), 0.5), "t": 2.0}
    u, _ = jax.jit(tx.update)(grads, state, params)
    ua, _ = optax.adamw(0.1, b1=0.9, b2=0.95, weight_decay=0.0).update(
        {"t": 2.0}, optax.adamw(0.1, b1=0.9, b2=0.95, weight_decay=0.0).init({"t": 1.0}),
        {"t": 1.0})
    np.testing.assert_allclose(np.asarray(u["t"]), np.asarray(ua["t"]), rtol=1e-6)
    assert np.abs(np.asarray(u["w"])).max() > 0


@pytest.mark.parametrize("bad,match", [
    ({"a": jnp.ones((8, 12)), "b": jnp.ones((8, 13))}, r"\['b'\] has shape \(8, 13\)"),
    ({"a": jnp.ones((8, 12)), "c": jnp.ones((8, 12))}, r"\['c'\]"),
    ({"a": jnp.ones((8, 12))}, "1 gradient leaves, 2 in the state"),
    ({"a": jnp.ones((8, 12)), "b": jnp.ones((8, 12), jnp.int32)}, r"\['b'\] has dtype int32"),
])
def test_mismatched_gradients_name_the_first_bad_leaf(bad, match):
    tx = dion3_jax.scale_by_dion3(0.5)
    state = tx.init({"a": jnp.ones((8, 12)), "b": jnp.ones((8, 12))})
    with pytest.raises(ValueError, match=match):
        tx.update(bad, state)


def test_integer_or_complex_params_name_the_leaf():
    tx = dion3_jax.scale_by_dion3(0.5)
    for dtype in (jnp.int32, jnp.complex64):
        with pytest.raises(ValueError, match=r"\['layer'\]\['kernel'\]"):
            tx.init({"layer": {"kernel": jnp.ones((8, 12), dtype)}})


def _jaxpr_size(jaxpr) -> int:
    """Equations of a jaxpr, nested sub-jaxprs included."""
    total = 0
    for eqn in jaxpr.eqns:
        total += 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            total += _jaxpr_size(sub)
    return total


@pytest.mark.parametrize("fraction", [1.0, 0.25])
def test_stacked_layers_trace_independent_of_depth(fraction):
    """Stacked blocks (one (layers, in, out) leaf per weight) are one batch each: the traced
    step has the same number of operations for 2 and for 16 layers, so compile time does not
    grow with depth (an unrolled model's grows linearly)."""
    sizes = {}
    for layers in (2, 16):
        params = {"q": jnp.ones((layers, 32, 32)), "up": jnp.ones((layers, 32, 64)),
                  "down": jnp.ones((layers, 64, 32))}
        tx = dion3_jax.scale_by_dion3(fraction)
        jaxpr = jax.make_jaxpr(tx.update)(params, tx.init(params))
        sizes[layers] = _jaxpr_size(jaxpr.jaxpr)
    assert sizes[2] == sizes[16], sizes
    unrolled = {f"{k}{i}": jnp.ones((32, 32)) for i in range(4) for k in "ab"}
    tx = dion3_jax.scale_by_dion3(fraction)
    four = _jaxpr_size(jax.make_jaxpr(tx.update)(unrolled, tx.init(unrolled)).jaxpr)
    two = {k: v for k, v in unrolled.items() if k[1] in "01"}
    assert four > _jaxpr_size(jax.make_jaxpr(tx.update)(two, tx.init(two)).jaxpr)


def test_default_mu_follows_the_fraction_and_the_reference_default_stays_reachable():
    """mu=None (default) is 0.95^(1/f); mu=0.95 is the reference's constant. Checked on the
    momentum after one step: unselected rows keep G, selected rows decay by the chosen mu.
    Run eagerly (op by op, without jit); the other steps in this file are jitted."""
    g = np.zeros((8, 16), np.float32)
    g[:, :4] = 2.0                               # rows 0..3 (outputs) are the top-4 at f = 1/4
    g[:, 4:] = 1.0
    for mu, want in ((None, 0.95 ** 4), (0.95, 0.95)):
        tx = dion3_jax.scale_by_dion3(0.25, mu=mu)
        _, state = tx.update({"w": jnp.asarray(g)}, tx.init({"w": jnp.zeros((8, 16))}))
        m = np.asarray(state.full_momentum()["w"])
        np.testing.assert_allclose(m[:, :4], want * 2.0, rtol=1e-6)
        np.testing.assert_array_equal(m[:, 4:], 1.0)
    assert dion3_jax.momentum_for_fraction(1.0) == 0.95
    assert abs(dion3_jax.momentum_for_fraction(0.125, 0.9) - 0.9 ** 8) < 1e-15


def test_folded_momentum_scale_continues_the_same_run():
    """``fold_momentum_scale`` moves the deferred decay into the momentum: ``momentum_scale``
    becomes ones, ``full_momentum()`` is unchanged, and the next update from the folded state
    equals the one from the state as it was within float32 rounding (fresh inputs; through the
    ``dion3`` alias, whose state nests the Dion3 node)."""
    rng = np.random.default_rng(SEED)
    params = {"w": jnp.asarray(rng.standard_normal((16, 48), np.float32))}
    grads = [{"w": jnp.asarray(rng.standard_normal((16, 48), np.float32))} for _ in range(3)]
    tx = dion3_jax.dion3(0.02, fraction=0.25)
    state = tx.init(params)
    update = jax.jit(tx.update)
    for g in grads[:2]:
        _, state = update(g, state, params)
    folded = dion3_jax.fold_momentum_scale(state)
    node = lambda s: s.inner_states["dion3"].inner_state[0]  # noqa: E731
    scale = np.asarray(node(state).momentum_scale["w"])
    assert np.any(scale != 1) and np.all(np.asarray(node(folded).momentum_scale["w"]) == 1)
    np.testing.assert_array_equal(np.asarray(node(folded).momentum["w"]),
                                  np.asarray(node(state).full_momentum()["w"]))
    assert jax.tree.structure(folded) == jax.tree.structure(state)
    u_state, _ = update(grads[2], state, params)
    u_folded, _ = update(grads[2], folded, params)
    np.testing.assert_allclose(np.asarray(u_folded["w"]), np.asarray(u_state["w"]),
                               rtol=1e-5, atol=1e-7)
