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
"""Leaves sharded along two or three axes, as large JAX models lay them out, on 8 simulated CPU
devices: a (2, 2, 2) mesh of an expert-or-stage axis ``x``, ``fsdp`` and ``tp``.

Every layout must equal the one-device update (global scope at any f, and every scope at
f = 1), keep every sharding, compile once, and megabatch: two all-to-alls per shape group at
any depth, moving the selected rows only (bytes ∝ f), never gathering a whole matrix.

Inputs are drawn fresh from ``SEED`` (printed with every test's output).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import numpy as np
import pytest

import dion3_jax
from dion3_jax import DimensionNumbers
from hlo_census import count_op, op_result_sizes
from seeds import module_seed

SEED = module_seed()
pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")
MO = dion3_jax.MeshOptions
DENSE_GENERAL = DimensionNumbers(reduction_axis=0, output_axis=(1, 2))   # (embed, heads, hd)
SCANNED = DimensionNumbers(reduction_axis=0, output_axis=2)            # (embed, layers, mlp)

#: name → (shape, spec, dimension numbers): every two- and three-axis layout of the frameworks'
#: default rules, Flax (in, out) kernels unless said otherwise.
LAYOUTS = {
    "mlp_up": ((32, 64), P("fsdp", "tp"), None),            # FSDP × TP: columns × rows
    "mlp_down": ((64, 32), P("tp", "fsdp"), None),          # TP × FSDP: the other orientation
    "qkv": ((32, 4, 8), P("fsdp", "tp", None), DENSE_GENERAL),
    "experts_fsdp": ((4, 32, 48), P("x", "fsdp", None), None),
    "experts_tp": ((4, 32, 48), P("x", None, "tp"), None),
    "stages": ((2, 32, 48), P("x", "fsdp", "tp"), None),    # stages × FSDP × TP
    "scanned": ((32, 2, 48), P("fsdp", None, "tp"), SCANNED),
    "tuple_axes": ((32, 64), P("fsdp", ("tp", "x")), None),  # a tuple of mesh axes per entry
}


def mesh(axis_type=AxisType.Explicit):
    return jax.make_mesh((2, 2, 2), ("x", "fsdp", "tp"), axis_types=(axis_type,) * 3)


def dims(layouts):
    return {k: v[2] for k, v in layouts.items()}


def draw(layouts, rng):
    return {k: rng.standard_normal(v[0]).astype(np.float32) for k, v in layouts.items()}


def canonical(spec: P) -> P:
    """``spec`` without trailing Nones: the form jit gives its outputs under Auto axes (except
    those equivalent to its first argument's), so inputs so placed compile one program."""
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def put(tree, layouts, m):
    auto = AxisType.Auto in m.axis_types
    return {k: jax.device_put(v, NamedSharding(m, canonical(layouts[k][1]) if auto
                                                 else layouts[k][1]))
            for k, v in tree.items()}


def newton_schulz_30(x):
    """A user's orthogonalizer: 30 cubic Newton-Schulz steps in float32 (zero-safe)."""
    x = x.astype(jnp.float32)
    x = x / (jnp.linalg.norm(x, axis=(-2, -1), keepdims=True) + 1e-7)
    step = lambda _, y: 1.5 * y - 0.5 * y @ jnp.swapaxes(y, -1, -2) @ y  # noqa: E731
    return jax.lax.fori_loop(0, 30, step, x)


POLARS = {   # name → (orthogonalizer keyword arguments, tolerance against one device)
    "float32": (dict(orthogonalizer=dion3_jax.make_orthogonalizer(
        method="standard", compute_dtype=jnp.float32)), 1e-5),
    "default": ({}, 5e-3),
    "callable": (dict(orthogonalizer=newton_schulz_30), 1e-5),
}


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def steps(tx, params, grads, m=None, layouts=None):
    """Two jitted updates; the updates, the last state and the number of compiles."""
    state = tx.init(params if m is None else put(params, layouts, m))
    update = jax.jit(tx.update)
    outs = []
    for g in grads:
        u, state = update(g if m is None else put(g, layouts, m), state)
        outs.append(u)
    return outs, state, update._cache_size()


#: The layouts the other polars are checked on (one of each kind of exchange: FSDP × TP tiles
#: both ways, a batch-split tile), to keep the suite's time.
FEW = ("mlp_up", "mlp_down", "stages")


@functools.cache
def one_device(polar: str, fraction: float, scope: str, names: tuple[str, ...]):
    layouts = {k: LAYOUTS[k] for k in names}
    rng = np.random.default_rng(SEED)
    params, grads = draw(layouts, rng), [draw(layouts, rng) for _ in range(2)]
    tx = dion3_jax.scale_by_dion3(fraction, dimension_numbers=dims(layouts),
                                  mesh_options=MO(selection_scope=scope), **POLARS[polar][0])
    return params, grads, steps(tx, params, grads)


def check_against_one_device(m, fraction, polar, scope, param_specs=None,
                             names: tuple[str, ...] = tuple(LAYOUTS)):
    layouts = {k: LAYOUTS[k] for k in names}
    params, grads, (ref, ref_state, _) = one_device(polar, fraction, scope, names)
    kw, tol = POLARS[polar]
    with jax.set_mesh(m):
        tx = dion3_jax.scale_by_dion3(fraction, dimension_numbers=dims(layouts),
                                      mesh_options=MO(selection_scope=scope,
                                                      param_specs=param_specs), **kw)
        state0 = tx.init(put(params, layouts, m))
        before = jax.tree.map(lambda x: x.sharding, state0)
        outs, state, compiles = steps(tx, params, grads, m, layouts)
    assert compiles == 1
    for u, r in zip(outs, ref):
        for k in layouts:
            err = rel_err(u[k], r[k])
            assert err <= tol, f"{k} {LAYOUTS[k][1]}: {err:.3g} > {tol}"
            assert u[k].sharding.is_equivalent_to(NamedSharding(m, LAYOUTS[k][1]), u[k].ndim), k
    kept = jax.tree.map(lambda x, s: x.sharding.is_equivalent_to(s, x.ndim), state, before)
    assert all(jax.tree.leaves(kept))
    for k in layouts:   # the momentum too (compared folded: d ⊙ M)
        assert rel_err(state.full_momentum()[k], ref_state.full_momentum()[k]) <= tol, k


@pytest.mark.slow  # ~11 s; the fast loop keeps tiles through the local-scope test below and
# the global scope through test_distributed's global-scope test
@pytest.mark.parametrize("polar,fraction,scope", [
    ("float32", 0.25, "global"),
    pytest.param("float32", 1.0, "local", marks=pytest.mark.slow),
])
def test_every_layout_equals_one_device(polar, fraction, scope):
    check_against_one_device(mesh(), fraction, polar, scope)


@pytest.mark.slow
@pytest.mark.parametrize("polar", ["default", "callable"])
def test_tiles_equal_one_device_with_the_default_and_a_user_polar(polar):
    check_against_one_device(mesh(), 0.25, polar, "global", names=FEW)


@pytest.mark.slow
def test_auto_axes_with_param_specs_equal_one_device():
    specs = {k: LAYOUTS[k][1] for k in FEW}
    check_against_one_device(mesh(AxisType.Auto), 0.25, "float32", "global", specs, FEW)


def test_local_scope_selects_per_row_shard_whatever_the_column_tiles():
    """"local" on a tiled leaf: each row shard picks ``ceil(f · rows per shard)`` of its rows
    from their whole-row ℓ1 norms (partial sums over the column tiles, all-reduced), so the
    column tiles do not change the update: it equals the same leaf sharded by rows alone."""
    rng = np.random.default_rng(SEED)
    tiled = {"w": ((32, 64), P("fsdp", "tp"), None), "d": ((64, 32), P("tp", "fsdp"), None)}
    rows_only = {"w": ((32, 64), P(None, "tp"), None), "d": ((64, 32), P(None, "fsdp"), None)}
    params, grads = draw(tiled, rng), [draw(tiled, rng) for _ in range(2)]
    kw = POLARS["float32"][0]
    outs = {}
    m = mesh()
    for name, lay in (("tiled", tiled), ("rows", rows_only)):
        with jax.set_mesh(m):
            tx = dion3_jax.scale_by_dion3(0.25, mesh_options=MO(selection_scope="local"), **kw)
            outs[name] = steps(tx, params, grads, m, lay)[0]
    for a, b in zip(outs["tiled"], outs["rows"]):
        for k in a:
            assert rel_err(a[k], b[k]) <= 1e-5, k


def model(layers: int):
    """A MaxText-like stack: per layer an FSDP × TP up kernel, a TP × FSDP down kernel, an
    experts × FSDP stack and a tiled q kernel."""
    out = {}
    for i in range(layers):
        out[f"l{i}/up"] = ((64, 128), P("fsdp", "tp"), None)
        out[f"l{i}/down"] = ((128, 64), P("tp", "fsdp"), None)
        out[f"l{i}/experts"] = ((4, 64, 96), P("x", "fsdp", None), None)
        out[f"l{i}/q"] = ((64, 4, 16), P("fsdp", "tp", None), DENSE_GENERAL)
    return out


def census(layers: int, fraction: float) -> dict:
    """The compiled step's collectives: counts, and the largest result of each kind."""
    lay = model(layers)
    m = mesh()
    with jax.set_mesh(m):
        tx = dion3_jax.scale_by_dion3(fraction, dimension_numbers=dims(lay))
        params = put(draw(lay, np.random.default_rng(SEED)), lay, m)
        state = tx.init(params)
        hlo = jax.jit(tx.update).lower(params, state).compile().as_text()
    a2a = op_result_sizes(hlo, "all-to-all")
    return {"all-to-all": count_op(hlo, "all-to-all"), "all-to-all elements": sum(a2a),
            "all-gather": op_result_sizes(hlo, "all-gather"),
            "all-reduce": count_op(hlo, "all-reduce")}


@pytest.mark.slow
def test_collectives_per_shape_group_not_per_layer_and_bytes_scale_with_f():
    """4 shape groups (up, down, experts, q): 8 all-to-alls at 2 and at 4 layers, and as many
    all-reduces; the all-to-alls carry ``k × C`` per matrix (f = 1/4 moves a quarter of
    f = 1's elements, give or take the padding of the count to the axis size); no all-gather
    (local scope); no collective result as large as a whole matrix of a sharded leaf."""
    two, four = census(2, 0.25), census(4, 0.25)
    assert two["all-to-all"] == four["all-to-all"] == 2 * 4, (two, four)
    assert two["all-reduce"] == four["all-reduce"], (two, four)
    assert not two["all-gather"] and not four["all-gather"]
    full = census(2, 1.0)
    ratio = two["all-to-all elements"] / full["all-to-all elements"]
    assert 0.2 <= ratio <= 0.3, (ratio, two, full)
    # At f = 1 every device sends its piece of every payload and gets it back: each leaf's
    # matrices over the devices that hold distinct pieces of them (up, down and q: 4, the
    # fsdp × tp tiles, replicated over x; the experts: 4, x × fsdp), twice, with no padding
    # (the 2 layers' 8 experts per device group divide 4 devices; the 2 dense matrices per
    # group are padded to 4, with zero matrices that travel too).
    per_layer = (64 * 128 + 128 * 64 + 64 * 64) / 4 * 2 + 4 * 64 * 96 / 4
    assert full["all-to-all elements"] == 2 * 2 * per_layer, full


def test_errors_name_every_offending_leaf():
    """One ValueError for every leaf that cannot be planned, each with its path, shape and
    spec; the leaves that can are not named."""
    lay = {"fine": ((32, 64), P("fsdp", "tp"), None),
           "uneven": ((33, 64), P("fsdp", None), None),                    # 33 ∤ 2 devices
           "two_reductions": ((4, 8, 16), P(None, "fsdp", "tp"),           # two sharded
                              DimensionNumbers(reduction_axis=(1, 2), output_axis=0)),
           "fine_too": ((4, 32, 48), P("x", "fsdp", "tp"), None)}
    m = mesh()
    params = {k: jax.device_put(np.ones(v[0], np.float32), NamedSharding(m, P()))
              for k, v in lay.items()}
    with jax.set_mesh(m):
        tx = dion3_jax.scale_by_dion3(dimension_numbers=dims(lay), mesh_options=MO(
            param_specs={k: v[1] for k, v in lay.items()}))
        with pytest.raises(ValueError) as err:
            tx.init(params)
    msg = str(err.value)
    assert "2 leaves" in msg, msg
    for name in ("uneven", "two_reductions"):
        assert f"['{name}']" in msg and str(lay[name][0]) in msg, msg
    assert "P('fsdp', None)" in msg and "P(None, 'fsdp', 'tp')" in msg, msg   # as given
    assert "['fine']" not in msg and "['fine_too']" not in msg, msg


def test_auto_axes_without_param_specs_refuse_instead_of_moving_the_layout():
    """Under Auto axes traced values carry no sharding: without ``param_specs`` both ``init``
    and a jitted ``update`` raise a ValueError that says what to pass (a guessed layout moved a
    ``P("fsdp", "tp")`` kernel to ``P(("fsdp", "tp"), None)`` and cost the train step its
    layout), and the state passed in is left as it was."""
    m = mesh(AxisType.Auto)
    lay = {"up": ((32, 64), P("fsdp", "tp"), None)}
    params = put(draw(lay, np.random.default_rng(SEED)), lay, m)
    with jax.set_mesh(m):
        with pytest.raises(ValueError, match="Auto.*param_specs=jax.tree.map"):
            dion3_jax.scale_by_dion3().init(params)
        good = dion3_jax.scale_by_dion3(mesh_options=MO(param_specs=P("fsdp", "tp")))
        state = good.init(params)
        before = jax.tree.map(np.asarray, state)
        with pytest.raises(ValueError, match="param_specs"):
            jax.jit(dion3_jax.scale_by_dion3().update)(params, state)
        assert all(jax.tree.leaves(jax.tree.map(np.array_equal, before,
                                                jax.tree.map(np.asarray, state))))
