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
"""optax / Flax conformance of the aliases (dion3, muon, normuon)."""

from __future__ import annotations

import functools
import inspect
import typing

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dion3_jax
from platform_setup import committed

ALIASES = {
    "dion3": lambda **kw: dion3_jax.dion3(fraction=0.5, **kw),
    "muon": dion3_jax.muon,
    "normuon": dion3_jax.normuon,
    "dion3_lion": lambda **kw: dion3_jax.dion3(scalar_optimizer="lion", **kw),
}


def _params(dtype=jnp.float32):
    # NumPy draws here and below: jax.random would compile its sampler anew for every shape.
    rng = np.random.default_rng(0)
    return committed({"dense": {"kernel": rng.standard_normal((16, 24)).astype(dtype),
                                 "bias": np.zeros((24,), dtype)},
                       "embed": {"embedding": rng.standard_normal((50, 16)).astype(dtype)},
                       "out": {"kernel": rng.standard_normal((24, 8)).astype(dtype)}})


def _grads(params, seed=1):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape).astype(x.dtype)),
                        params)


def test_default_labels_route_embeddings_and_non_matrices_to_scalar():
    labels = dion3_jax.default_param_labels(_params())
    assert labels == {"dense": {"kernel": "dion3", "bias": "scalar"},
                      "embed": {"embedding": "scalar"}, "out": {"kernel": "dion3"}}
    p = {"lm_head": {"kernel": jnp.ones((4, 4))}, "wte": jnp.ones((4, 4)),
         "blocks": {"0": {"mlp": jnp.ones((4, 4))}}, "stack": jnp.ones((2, 4, 4)),
         "stack_bias": jnp.ones((2, 4)), "ln_f": {"scale": jnp.ones((2, 4))}}
    # a rank-3 leaf whose axes nobody gave is refused, naming it (it was silently AdamW)
    with pytest.raises(ValueError, match=r"\['stack'\]  shape=\(2, 4, 4\)"):
        dion3_jax.default_param_labels(p)
    no_stack = {k: v for k, v in p.items() if k != "stack"}
    assert dion3_jax.default_param_labels(no_stack) == {
        "lm_head": {"kernel": "scalar"}, "wte": "scalar", "blocks": {"0": {"mlp": "dion3"}},
        "stack_bias": "scalar", "ln_f": {"scale": "scalar"}}
    # one DimensionNumbers for all: every rank ≥ 2 leaf that is not an embedding, head or
    # vector (bias, norm scale: any rank) is a matrix
    one = dion3_jax.default_param_labels(p, dion3_jax.DimensionNumbers(-2, -1))
    assert one["stack"] == "dion3" and one["blocks"]["0"]["mlp"] == "dion3"
    assert one["stack_bias"] == one["ln_f"]["scale"] == one["wte"] == "scalar"
    # an explicit tree decides every leaf it covers, whatever its name (declarations win over
    # the vector and embedding/head names); the leaves it leaves out keep the name rules
    dn = dion3_jax.DimensionNumbers(0, 1)
    tree = {"lm_head": {"kernel": None}, "wte": dn, "blocks": None,
            "stack": dion3_jax.DimensionNumbers(1, 2), "stack_bias": dn}
    assert dion3_jax.default_param_labels(p, tree) == {
        "lm_head": {"kernel": "scalar"}, "wte": "dion3", "blocks": {"0": {"mlp": "scalar"}},
        "stack": "dion3", "stack_bias": "dion3", "ln_f": {"scale": "scalar"}}


@pytest.mark.slow
def test_matrix_branch_is_dion3_and_rest_is_adamw():
    params = _params()
    tx = dion3_jax.dion3(0.01, 0.5, weight_decay=0.0, adam_learning_rate=1e-3)
    grads = _grads(params)
    upd, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    adam = optax.adamw(1e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.0)
    aupd, _ = adam.update(grads, adam.init(params), params)
    np.testing.assert_allclose(upd["dense"]["bias"], aupd["dense"]["bias"], rtol=1e-6)
    np.testing.assert_allclose(upd["embed"]["embedding"], aupd["embed"]["embedding"], rtol=1e-6)
    direct = dion3_jax.scale_by_dion3(0.5)
    m = {"k": params["dense"]["kernel"]}
    dupd, _ = jax.jit(direct.update)({"k": grads["dense"]["kernel"]}, direct.init(m))
    np.testing.assert_allclose(upd["dense"]["kernel"], -0.01 * dupd["k"], rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ALIASES))
def test_inject_hyperparams_equals_plain(name):
    params, grads = _params(), _grads(_params())
    plain = ALIASES[name](learning_rate=0.02)
    static = ("fraction",) if name.startswith("dion3") else ()
    factory = {"dion3": dion3_jax.dion3, "dion3_lion": dion3_jax.dion3, "muon": dion3_jax.muon,
               "normuon": dion3_jax.normuon}[name]
    kw = {"fraction": 0.5} if name == "dion3" else {}
    if name == "dion3_lion":
        kw = {"scalar_optimizer": "lion"}
    injected = optax.inject_hyperparams(factory, static_args=static)(learning_rate=0.02, **kw)
    s1, s2 = committed(plain.init(params)), committed(injected.init(params))
    for _ in range(2):
        u1, s1 = jax.jit(plain.update)(grads, s1, params)
        u2, s2 = jax.jit(injected.update)(grads, s2, params)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), u1, u2)


@functools.cache
def _injected_dion3():
    """``dion3`` at f = 1/2 (learning rate 0.02) through ``optax.inject_hyperparams``, its
    ``fraction`` static, and its jitted update: one compile for the two tests below."""
    tx = optax.inject_hyperparams(dion3_jax.dion3, static_args=("fraction",))(
        learning_rate=0.02, fraction=0.5)
    return tx, jax.jit(tx.update)


@pytest.mark.slow  # test_inject.py checks the refusal and the injected step in the fast loop
def test_injected_fraction_must_be_static():
    params, grads = _params(), _grads(_params())
    tx = optax.inject_hyperparams(dion3_jax.dion3)(learning_rate=0.02, fraction=0.5)
    with pytest.raises(ValueError, match="static_args=.'fraction'"):   # at init, not update
        tx.init(params)
    tx, update = _injected_dion3()
    update(grads, tx.init(params), params)


@pytest.mark.slow
def test_learning_rate_schedule_and_injected_lr_change():
    params, grads = _params(), _grads(_params())
    sched = optax.linear_schedule(0.0, 0.1, 10)
    tx = dion3_jax.dion3(sched, 0.5)
    state = tx.init(params)
    u0, state = jax.jit(tx.update)(grads, state, params)
    assert all(float(jnp.abs(x).max()) == 0.0 for x in jax.tree.leaves(u0))  # lr(0) = 0, wd·0
    u1, state = jax.jit(tx.update)(grads, state, params)
    assert float(jnp.abs(u1["dense"]["kernel"]).max()) > 0
    inj, update = _injected_dion3()                       # learning rate 0.02
    s = inj.init(params)
    ua, _ = update(grads, s, params)
    s.hyperparams["learning_rate"] = jnp.float32(0.04)     # its dtype: the step compiles once
    ub, _ = update(grads, s, params)
    np.testing.assert_allclose(ub["dense"]["kernel"], 2 * ua["dense"]["kernel"], rtol=1e-5)


@pytest.mark.slow
def test_multisteps_accumulates():
    params, grads = _params(), _grads(_params())
    tx = optax.MultiSteps(dion3_jax.dion3(0.02, 0.5), every_k_schedule=3)
    state = committed(tx.init(params))
    step = jax.jit(tx.update)
    for i in range(3):
        upd, state = step(grads, state, params)
        nonzero = any(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(upd))
        assert nonzero == (i == 2)


def test_init_on_abstract_inputs():
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _params())
    state = jax.eval_shape(dion3_jax.dion3(0.02).init, params)
    concrete = dion3_jax.dion3(0.02).init(_params())
    spec = lambda t: jax.tree.map(lambda x: (x.shape, x.dtype), t)
    assert spec(state) == spec(concrete)
    direct = dion3_jax.scale_by_dion3().init({"w": jax.ShapeDtypeStruct((8, 4), jnp.bfloat16)})
    assert direct.momentum["w"].shape == (8, 4)


def test_weight_decay_and_mask():
    # two matrices ("b" here was a vector name: that leaf went to AdamW, whose zero update
    # passed the mask check without a mask)
    params = {"a": jnp.ones((8, 12)), "c": jnp.ones((8, 12))}
    assert dion3_jax.default_param_labels(params) == {"a": "dion3", "c": "dion3"}
    zeros = jax.tree.map(jnp.zeros_like, params)
    tx = dion3_jax.dion3(0.1, 0.5, weight_decay=0.5, weight_decay_mask={"a": True, "c": False})
    upd, _ = jax.jit(tx.update)(zeros, tx.init(params), params)
    np.testing.assert_allclose(upd["a"], -0.05 * np.ones((8, 12)), rtol=1e-6)
    np.testing.assert_allclose(upd["c"], 0.0, atol=0)


def test_scalar_weight_decay_mask():
    params = {"embed": jnp.ones((6, 4)), "norm": {"scale": jnp.ones((4,))}}
    zeros = jax.tree.map(jnp.zeros_like, params)
    tx = dion3_jax.dion3(0.1, adam_weight_decay=0.5,
                         adam_weight_decay_mask={"embed": True, "norm": {"scale": False}})
    upd, _ = tx.update(zeros, tx.init(params), params)
    np.testing.assert_allclose(upd["embed"], -0.05 * np.ones((6, 4)), rtol=1e-6)
    np.testing.assert_allclose(upd["norm"]["scale"], 0.0, atol=0)


def test_chains_with_other_transforms():
    params, grads = _params(), _grads(_params())
    tx = optax.chain(optax.clip_by_global_norm(1.0), dion3_jax.dion3(0.02, 0.25))
    upd, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(upd))


def test_transfer_learning_rate():
    assert dion3_jax.transfer_learning_rate(0.01, 1.0, 0.25) == pytest.approx(0.02)
    lr = dion3_jax.transfer_learning_rate(0.02, 0.25, 0.0625)
    assert lr * 0.0625**0.5 == pytest.approx(0.02 * 0.25**0.5)
    with pytest.raises(ValueError, match="to_fraction"):
        dion3_jax.transfer_learning_rate(0.01, 1.0, 0.0)


def test_matrix_parabola_converges():
    target = jnp.asarray(np.random.default_rng(3).standard_normal((32, 48), np.float32))
    params = committed({"w": jnp.zeros((32, 48))})
    loss = lambda p: jnp.mean((p["w"] - target) ** 2)
    tx = dion3_jax.dion3(optax.cosine_decay_schedule(0.3, 400), 0.25, weight_decay=0.0)
    state = tx.init(params)

    @jax.jit
    def step(p, s):
        g = jax.grad(loss)(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    l0 = float(loss(params))
    for _ in range(400):
        params, state = step(params, state)
    assert float(loss(params)) < 1e-2 * l0


class _Tiny(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(32, 16, rngs=rngs)
        self.l1 = nnx.Linear(16, 32, rngs=rngs)
        self.l2 = nnx.Linear(32, 16, rngs=rngs)
        self.lm_head = nnx.Linear(16, 32, rngs=rngs)

    def __call__(self, tokens):
        h = self.embed(tokens)
        h = h + self.l2(jax.nn.gelu(self.l1(h)))
        return self.lm_head(h)


@pytest.mark.slow
def test_flax_nnx_optimizer_trains():
    model = _Tiny(nnx.Rngs(0))
    opt = nnx.Optimizer(model, dion3_jax.dion3(0.05, 0.25, adam_learning_rate=1e-2),
                        wrt=nnx.Param)
    for obj in (model, opt):   # committed like the step's outputs: the step compiles once
        nnx.update(obj, committed(nnx.state(obj)))
    labels = dion3_jax.default_param_labels(nnx.state(model, nnx.Param))
    assert labels["l1"]["kernel"] == "dion3" and labels["embed"]["embedding"] == "scalar"
    assert labels["lm_head"]["kernel"] == "scalar" and labels["l1"]["bias"] == "scalar"
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 32, (8, 12)), jnp.int32)

    def loss_fn(m):
        logits = m(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    @nnx.jit
    def step(m, o):
        loss, grads = nnx.value_and_grad(loss_fn)(m)
        o.update(m, grads)
        return loss

    losses = [float(step(model, opt)) for _ in range(40)]
    assert losses[-1] < 0.7 * losses[0], losses[::10]


def _parameters(fn) -> list[tuple[str, str, object]]:
    return [(p.name, p.kind.name, p.default) for p in inspect.signature(fn).parameters.values()]


def test_aliases_share_one_set_of_options():
    """``muon`` and ``normuon`` take ``dion3``'s keyword-only options except ``flavor``, with the
    same defaults and annotations; their positional parameters are pinned here."""
    pos = {name: [(n, d) for n, k, d in _parameters(fn) if k == "POSITIONAL_OR_KEYWORD"]
           for name, fn in (("dion3", dion3_jax.dion3), ("muon", dion3_jax.muon),
                            ("normuon", dion3_jax.normuon))}
    assert pos == {
        "dion3": [("learning_rate", inspect.Parameter.empty), ("fraction", 0.25), ("mu", None),
                  ("beta2", 0.95), ("weight_decay", 0.01), ("weight_decay_mask", None)],
        "muon": [("learning_rate", inspect.Parameter.empty), ("mu", 0.95),
                 ("weight_decay", 0.01), ("weight_decay_mask", None)],
        "normuon": [("learning_rate", inspect.Parameter.empty), ("mu", 0.95), ("beta2", 0.95),
                    ("weight_decay", 0.01), ("weight_decay_mask", None)]}
    full = inspect.signature(dion3_jax.dion3).parameters
    keywords = [p for p in full.values() if p.kind is p.KEYWORD_ONLY]
    assert len(keywords) == 17 and keywords[0].name == "flavor"
    for fn in (dion3_jax.muon, dion3_jax.normuon):
        params = inspect.signature(fn).parameters
        assert [p for p in params.values() if p.kind is p.KEYWORD_ONLY] == keywords[1:]
        assert all(params[n].annotation == full[n].annotation for n in params)
        assert typing.get_type_hints(fn)["param_labels"] == typing.get_type_hints(
            dion3_jax.dion3)["param_labels"]
    with pytest.raises(TypeError, match="beta2"):
        dion3_jax.muon(0.01, beta2=0.9)
    with pytest.raises(TypeError, match="flavor"):
        dion3_jax.normuon(0.01, flavor="muon")
    with pytest.raises(TypeError):
        dion3_jax.muon(0.01, 0.9, 0.0, None, "rms_norm")   # the options are keyword-only


@pytest.mark.parametrize("name", ["muon", "normuon"])
def test_muon_and_normuon_are_dion3_at_fraction_one(name):
    """Bitwise the updates of ``dion3`` at ``f = 1`` with the alias's flavor and defaults (the
    definition of the aliases), options passed positionally and by keyword alike."""
    params, grads = _params(), _grads(_params())
    kw = dict(adjust_lr="rms_norm", adam_learning_rate=3e-3, adam_weight_decay=0.1)
    if name == "muon":
        alias = dion3_jax.muon(0.02, 0.9, 0.05, None, **kw)
        ref = dion3_jax.dion3(0.02, 1.0, 0.9, 0.95, 0.05, flavor="muon", **kw)
    else:
        alias = dion3_jax.normuon(0.02, 0.9, beta2=0.8, weight_decay=0.05, **kw)
        ref = dion3_jax.dion3(0.02, 1.0, 0.9, 0.8, 0.05, flavor="normuon", **kw)
    s1, s2 = committed(alias.init(params)), committed(ref.init(params))
    for _ in range(2):
        u1, s1 = jax.jit(alias.update)(grads, s1, params)
        u2, s2 = jax.jit(ref.update)(grads, s2, params)
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                     u1, u2)
