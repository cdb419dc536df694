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
"""Routing of real Flax layouts: stacked (nnx.vmap / nnx.scan / nn.scan) blocks, Linen default
names, MoE expert stacks, multi-axis attention kernels; the routing table; Python float leaves.

Each test fails on the old rule (2-D and not an embedding/head name: Dion3; anything else:
AdamW, silently).
"""

from __future__ import annotations

import pathlib
import re

from flax import linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dion3_jax

STACKED = dion3_jax.DimensionNumbers(reduction_axis=-2, output_axis=-1)
FIX = re.escape("dimension_numbers=dion3_jax.DimensionNumbers(reduction_axis=-2, output_axis=-1)")


def _normal(rng, shape):
    """A float32 standard normal array from NumPy (jax.random compiles its sampler anew for every
    shape)."""
    return jnp.asarray(rng.standard_normal(shape, np.float32))


def _like(tree, seed):
    """Random normal arrays shaped like ``tree``'s leaves."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: _normal(rng, jnp.shape(x)), tree)


def _adamw_update(grads, params, lr=1e-2):
    adam = optax.adamw(lr, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.0)
    return adam.update(grads, adam.init(params), params)[0]


def _table_rows(table: str) -> dict[str, list[str]]:
    """``path -> [shape, optimizer, matrices, rule]`` parsed from :func:`routing_table`."""
    rows = {}
    for line in table.splitlines()[2:-1]:
        cells = re.split(r"\s{2,}", line.strip())
        rows[cells[0]] = cells[1:]
    return rows


# ------------------------------------------------------------------------------------------
# NNX: blocks stacked with nnx.vmap, run with nnx.scan


class Block(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(8, rngs=rngs)
        self.mlp = nnx.Linear(8, 16, rngs=rngs)
        self.proj = nnx.Linear(16, 8, rngs=rngs)

    def __call__(self, x):
        return x + self.proj(jax.nn.gelu(self.mlp(self.norm(x))))


class StackedLM(nnx.Module):
    def __init__(self, rngs, layers=3):
        self.embed = nnx.Embed(32, 8, rngs=rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return Block(rngs)

        self.blocks = make(rngs)
        self.lm_head = nnx.Linear(8, 32, rngs=rngs)

    def __call__(self, tokens):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def body(block, h):
            return block(h)

        return self.lm_head(body(self.blocks, self.embed(tokens)))


def test_nnx_stacked_kernels_are_refused_naming_the_leaf():
    # The refusal reads shapes only: an abstract model (building a real one compiles its init).
    model = nnx.eval_shape(lambda: StackedLM(nnx.Rngs(0)))
    with pytest.raises(ValueError) as err:
        nnx.Optimizer(model, dion3_jax.dion3(0.02), wrt=nnx.Param)
    msg = str(err.value)
    assert "['blocks']['mlp']['kernel']  shape=(3, 8, 16)" in msg
    assert "['blocks']['proj']['kernel']  shape=(3, 16, 8)" in msg
    assert re.search(FIX, msg) and "bias" not in msg and "norm" not in msg


@pytest.mark.slow
def test_nnx_stacked_model_routes_per_layer_and_round_trips():
    model = StackedLM(nnx.Rngs(0))
    labels = dion3_jax.default_param_labels(nnx.state(model, nnx.Param), STACKED)
    flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(labels)[0]}
    dion = sorted(p for p, v in flat.items() if v == "dion3")
    assert dion == ["['blocks']['mlp']['kernel'].value", "['blocks']['proj']['kernel'].value"]
    rows = _table_rows(dion3_jax.routing_table(nnx.state(model, nnx.Param),
                                               dimension_numbers=STACKED))
    assert rows["['blocks']['mlp']['kernel']"][:3] == ["(3, 8, 16)", "dion3", "3 × 16×8"]
    assert rows["['blocks']['norm']['scale']"][1] == "scalar"
    assert rows["['blocks']['mlp']['bias']"][:2] == ["(3, 16)", "scalar"]

    tx = dion3_jax.dion3(0.02, 0.5, weight_decay=0.0, dimension_numbers=STACKED,
                         adam_learning_rate=1e-2)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    before = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 32, (2, 6)), jnp.int32)

    @nnx.jit
    def step(model, optimizer):
        grads = nnx.grad(lambda m: optax.softmax_cross_entropy_with_integer_labels(
            m(tokens[:, :-1]), tokens[:, 1:]).mean())(model)
        optimizer.update(model, grads)
        return grads

    grads = step(model, optimizer)
    after = nnx.state(model, nnx.Param)
    # AdamW's first step moves each entry by lr·g/(|g|+eps): the stacked biases went to AdamW
    delta = after["blocks"]["mlp"]["bias"][...] - before["blocks"]["mlp"]["bias"][...]
    g = grads["blocks"]["mlp"]["bias"][...]
    np.testing.assert_allclose(delta, -1e-2 * g / (jnp.abs(g) + 1e-8), rtol=1e-4, atol=1e-7)
    moved = after["blocks"]["mlp"]["kernel"][...] - before["blocks"]["mlp"]["kernel"][...]
    assert bool(jnp.all(jnp.abs(moved).reshape(3, -1).max(axis=1) > 0))  # every layer moved


# ------------------------------------------------------------------------------------------
# Linen: nn.scan over blocks; default names


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = nn.Dense(8)(nn.LayerNorm()(x))
        return x + h, None


class LinenScanned(nn.Module):
    @nn.compact
    def __call__(self, x):
        scan = nn.scan(LinenBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                       length=3)
        x, _ = scan(name="blocks")(x, None)
        return nn.Dense(5, name="head")(x)


@pytest.mark.slow
def test_linen_scan_stacked_biases_go_to_adamw():
    params = LinenScanned().init(jax.random.key(0), jnp.ones((2, 8)))
    with pytest.raises(ValueError, match=r"\['params'\]\['blocks'\]\['Dense_0'\]\['kernel'\]"
                                         r"  shape=\(3, 8, 8\)"):
        dion3_jax.dion3(0.02).init(params)
    labels = dion3_jax.default_param_labels(params, STACKED)["params"]
    assert labels["blocks"]["Dense_0"] == {"kernel": "dion3", "bias": "scalar"}
    assert labels["blocks"]["LayerNorm_0"] == {"scale": "scalar", "bias": "scalar"}
    assert labels["head"] == {"kernel": "scalar", "bias": "scalar"}
    state = dion3_jax.dion3(0.02, 0.5, dimension_numbers=STACKED).init(params)
    held = [jax.tree_util.keystr(p) for p, _ in
            jax.tree_util.tree_flatten_with_path(state.inner_states["dion3"])[0]]
    assert any("['Dense_0']['kernel']" in p for p in held)   # Dion3 holds the kernels only
    assert not any("bias" in p or "LayerNorm" in p or "head" in p for p in held)


class LinenMLP(nn.Module):
    head_name: str | None = None

    @nn.compact
    def __call__(self, x):
        x = jax.nn.gelu(nn.Dense(16)(x))
        x = jax.nn.gelu(nn.Dense(16)(x))
        return nn.Dense(4, name=self.head_name)(x)


def test_linen_default_names_are_refused_until_the_head_is_known():
    params = LinenMLP().init(jax.random.key(0), jnp.ones((2, 8)))
    with pytest.raises(ValueError) as err:
        dion3_jax.dion3(0.02).init(params)
    msg = str(err.value)
    assert "Dense_0, Dense_1, Dense_2" in msg and 'name="head"' in msg
    assert "['params']['Dense_2']['kernel']  shape=(16, 4)" in msg
    assert 'head_pattern="^Dense_2$"' in msg and "head_pattern=None" in msg
    named = LinenMLP(head_name="head").init(jax.random.key(0), jnp.ones((2, 8)))
    labels = dion3_jax.default_param_labels(named)["params"]
    assert [labels[k]["kernel"] for k in ("Dense_0", "Dense_1", "head")] == [
        "dion3", "dion3", "scalar"]
    said = dion3_jax.default_param_labels(params, head_pattern="^Dense_2$")["params"]
    assert [said[k]["kernel"] for k in ("Dense_0", "Dense_1", "Dense_2")] == [
        "dion3", "dion3", "scalar"]
    tx = dion3_jax.dion3(0.02, param_labels=lambda p: dion3_jax.default_param_labels(
        p, head_pattern="^Dense_2$"))
    tx.init(params)   # the one-line fix of the message works


# ------------------------------------------------------------------------------------------
# Recipes: MoE expert stacks, multi-axis attention kernels


@pytest.mark.slow
def test_moe_expert_stack_is_one_matrix_per_expert():
    rng = np.random.default_rng(0)
    # Committed like the state a step returns: each jitted step below compiles once.
    params = jax.device_put({"router": {"kernel": _normal(rng, (8, 4))},
                             "experts": {"kernel": _normal(rng, (3, 8, 16)),
                                         "bias": jnp.zeros((3, 16))}}, jax.devices()[0])
    grads = [_like(params, s) for s in (1, 2)]
    tx = dion3_jax.dion3(0.02, 0.5, dimension_numbers=STACKED, adam_learning_rate=1e-2)
    rows = _table_rows(dion3_jax.routing_table(params, dimension_numbers=STACKED))
    assert rows["['experts']['kernel']"][1:3] == ["dion3", "3 × 16×8"]
    assert rows["['experts']['bias']"][1] == "scalar"
    step = jax.jit(tx.update)
    state, got = tx.init(params), []
    for g in grads:
        u, state = step(g, state, params)
        got.append(u["experts"])
    one = dion3_jax.dion3(0.02, 0.5, adam_learning_rate=1e-2)
    step1 = jax.jit(one.update)
    for e in range(3):
        pe = jax.tree.map(lambda x, e=e: x[e], params["experts"])
        s = one.init(pe)
        for g, want in zip(grads, got):
            u, s = step1(jax.tree.map(lambda x, e=e: x[e], g["experts"]), s, pe)
            for name in ("kernel", "bias"):
                np.testing.assert_allclose(want[name][e], u[name], rtol=2e-5, atol=1e-7)


def attention_dims(params):
    """The docs/ROUTING.md recipe: attention kernels span several axes, the other kernels are
    (..., in, out), and every other leaf goes to the scalar optimizer."""
    def one(path, leaf):
        names = {str(getattr(k, "key", k)) for k in path}
        if "kernel" not in names or names & {"lm_head", "head"}:  # biases, norms, embeddings
            return None
        if "attn" in names and "out" in names:                     # (..., heads, hd, embed)
            return dion3_jax.DimensionNumbers(reduction_axis=(-3, -2), output_axis=-1)
        if "attn" in names and names & {"query", "key", "value"}:  # (..., embed, heads, hd)
            return dion3_jax.DimensionNumbers(reduction_axis=-3, output_axis=(-2, -1))
        return dion3_jax.DimensionNumbers(reduction_axis=-2, output_axis=-1)
    return jax.tree_util.tree_map_with_path(one, params)


@pytest.mark.slow
def test_attention_kernel_recipe_matches_the_2d_matrix():
    rng = np.random.default_rng(0)
    attn = {"query": {"kernel": _normal(rng, (8, 2, 4)), "bias": jnp.zeros((2, 4))},
            "out": {"kernel": _normal(rng, (2, 4, 8))}}
    with pytest.raises(ValueError, match=r"\['attn'\]\['query'\]\['kernel'\]  shape=\(8, 2, 4\)"):
        dion3_jax.default_param_labels({"attn": attn})
    flat = {"query": {"kernel": attn["query"]["kernel"].reshape(8, 8)},
            "out": {"kernel": attn["out"]["kernel"].reshape(8, 8)}}
    params = {"attn": attn, "flat": flat}
    grads = _like(params, 1)
    grads["flat"] = {"query": {"kernel": grads["attn"]["query"]["kernel"].reshape(8, 8)},
                     "out": {"kernel": grads["attn"]["out"]["kernel"].reshape(8, 8)}}
    rows = _table_rows(dion3_jax.routing_table(params, dimension_numbers=attention_dims))
    assert rows["['attn']['query']['kernel']"][1:3] == ["dion3", "1 × 8×8"]
    assert rows["['attn']['query']['bias']"][1] == "scalar"
    heads = _table_rows(dion3_jax.routing_table(params, dimension_numbers=attention_dims,
                                                num_heads={"attn": {"query": 2}}))
    assert heads["['attn']['query']['kernel']"][2] == "2 × 4×8"
    tx = dion3_jax.dion3(0.02, 0.5, dimension_numbers=attention_dims)
    u = jax.jit(tx.update)(grads, tx.init(params), params)[0]
    for name in ("query", "out"):
        np.testing.assert_allclose(u["attn"][name]["kernel"].reshape(8, 8),
                                   u["flat"][name]["kernel"], rtol=2e-5, atol=1e-7)


# ------------------------------------------------------------------------------------------
# The routing table; Python float leaves


def _mixed():
    return {"embed": {"embedding": jnp.ones((16, 8))},
            "blocks": {"qkv": {"kernel": jnp.ones((2, 8, 24))},
                       "o": {"kernel": jnp.ones((2, 8, 8))},
                       "norm": {"scale": jnp.ones((2, 8))}},
            "lm_head": {"kernel": jnp.ones((8, 16))}, "t": 1.0}


def test_routing_table_contents():
    table = dion3_jax.routing_table(
        _mixed(), dimension_numbers=STACKED, num_heads={"blocks": {"o": 2}},
        split_sizes={"blocks": {"qkv": (8, 8, 8)}})
    rows = _table_rows(table)
    assert table.splitlines()[0].split()[:3] == ["path", "shape", "optimizer"]
    assert rows["['blocks']['qkv']['kernel']"] == [
        "(2, 8, 24)", "dion3", "2 × 8×8 + 2 × 8×8 + 2 × 8×8", "dimension_numbers"]
    assert rows["['blocks']['o']['kernel']"][:3] == ["(2, 8, 8)", "dion3", "4 × 4×8"]
    assert rows["['blocks']['norm']['scale']"] == ["(2, 8)", "scalar", "-", "vector name 'norm'"]
    assert rows["['embed']['embedding']"][1] == rows["['lm_head']['kernel']"][1] == "scalar"
    assert rows["['t']"] == ["()", "scalar", "-", "rank 0"]
    assert table.splitlines()[-1] == (
        "dion3: 2 leaves, 512 parameters; scalar: 4 leaves, 273 parameters")


def test_routing_table_applies_the_optimizers_rules():
    params = _mixed()
    with pytest.raises(ValueError, match=FIX) as table_err:
        dion3_jax.routing_table(params)
    with pytest.raises(ValueError) as init_err:
        dion3_jax.dion3(0.02).init(params)
    assert str(table_err.value) == str(init_err.value)
    labels = dion3_jax.default_param_labels(params, STACKED)
    rows = _table_rows(dion3_jax.routing_table(params, dimension_numbers=STACKED))
    flat = jax.tree_util.tree_flatten_with_path(labels)[0]
    assert {jax.tree_util.keystr(p): v for p, v in flat} == {p: r[1] for p, r in rows.items()}
    mine = {"embed": "dion3", "blocks": "scalar", "lm_head": "scalar", "t": "scalar"}
    rows = _table_rows(dion3_jax.routing_table(params, param_labels=mine))
    assert rows["['embed']['embedding']"] == ["(16, 8)", "dion3", "1 × 8×16", "param_labels"]
    with pytest.raises(ValueError, match=r"\['t'\] the label 'adam'"):
        dion3_jax.routing_table(params, param_labels={**mine, "t": "adam"})


@pytest.mark.slow
def test_python_float_leaf_goes_to_adamw():
    params = {"w": jnp.ones((8, 16)), "t": 1.0}
    assert dion3_jax.default_param_labels(params) == {"w": "dion3", "t": "scalar"}
    assert _table_rows(dion3_jax.routing_table(params))["['t']"][:2] == ["()", "scalar"]
    tx = dion3_jax.dion3(0.02, adam_learning_rate=1e-2)
    grads = {"w": jnp.ones((8, 16)), "t": 0.5}
    upd = tx.update(grads, tx.init(params), params)[0]
    np.testing.assert_allclose(upd["t"], _adamw_update(grads, params)["t"], rtol=1e-6)


@pytest.mark.parametrize("name,label", [
    # substrings of a name decide nothing: the whole path component must match
    ("abnormal_proj", "dion3"), ("normalizer", "dion3"), ("prenorm", "dion3"),
    ("biased_proj", "dion3"), ("embedded_proj", "dion3"), ("header", "dion3"),
    ("tokenizer_proj", "dion3"), ("variance_proj", "dion3"), ("gate", "dion3"),
    ("dt_proj", "dion3"), ("x_proj", "dion3"), ("out_proj", "dion3"), ("A", "dion3"),
    ("w", "dion3"), ("x", "dion3"), ("bd", "dion3"),
    # norm layers, biases, scales, tokens: any rank
    ("norm", "scalar"), ("q_norm", "scalar"), ("input_layernorm", "scalar"),
    ("final_layer_norm", "scalar"), ("LayerNorm_0", "scalar"), ("RMSNorm_1", "scalar"),
    ("norm1", "scalar"), ("norm_out", "scalar"), ("ln_f", "scalar"), ("lnf", "scalar"),
    ("bn_1", "scalar"), ("bias", "scalar"), ("q_bias", "scalar"), ("bias_ih", "scalar"),
    ("attn_scale", "scalar"), ("cls_token", "scalar"),
    # 2-D parameters that are not linear maps
    ("A_log", "scalar"), ("dt_bias", "scalar"),
    ("relative_position_bias_table", "scalar"),
    # token and position embeddings, heads
    ("pos_embed", "scalar"), ("wpe", "scalar"), ("position_embedding", "scalar"),
    ("position_embeddings", "scalar"), ("pos_emb", "scalar"), ("rel_pos_h", "scalar"),
    ("positional_encoding", "scalar"), ("embed_tokens", "scalar"), ("wte", "scalar"),
    ("lm_head", "scalar"), ("unembedding", "scalar"), ("classifier", "scalar"),
])
def test_default_patterns_match_whole_path_components(name, label):
    params = {"block": {name: jnp.ones((64, 16)), "kernel": jnp.ones((16, 16))}}
    labels = dion3_jax.default_param_labels(params)
    assert labels["block"][name] == label, dion3_jax.routing_table(params)
    assert labels["block"]["kernel"] == "dion3"


def test_mamba_state_space_parameters_go_to_the_scalar_optimizer():
    """A Mamba block's ``A_log`` ``(d_inner, d_state)`` is a decay table, not a linear map; it
    was orthogonalized with no warning. Its projections stay matrices; the table says why."""
    mixer = {"in_proj": {"kernel": jnp.ones((16, 64))}, "x_proj": {"kernel": jnp.ones((32, 8))},
             "dt_proj": {"kernel": jnp.ones((4, 32)), "bias": jnp.ones((32,))},
             "A_log": jnp.ones((32, 16)), "D": jnp.ones((32,)), "dt_bias": jnp.ones((32,)),
             "out_proj": {"kernel": jnp.ones((32, 16))}}
    labels = dion3_jax.default_param_labels({"mixer": mixer})["mixer"]
    assert labels["A_log"] == labels["D"] == labels["dt_bias"] == "scalar"
    assert all(labels[k]["kernel"] == "dion3" for k in ("in_proj", "x_proj", "dt_proj",
                                                        "out_proj"))
    table = _table_rows(dion3_jax.routing_table({"mixer": mixer}))
    assert table["['mixer']['A_log']"][1:] == ["scalar", "-", "vector name 'A_log'"]


def test_user_patterns_match_whole_components_too():
    params = {"mix": jnp.ones((2, 8)), "mixer": {"kernel": jnp.ones((8, 8))}}
    labels = dion3_jax.default_param_labels(
        params, vector_pattern=dion3_jax.routing.DEFAULT_VECTOR_PATTERN + "|mix")
    assert labels == {"mix": "scalar", "mixer": {"kernel": "dion3"}}


# ------------------------------------------------------------------------------------------
# Declarations win: a dimension_numbers tree or callable decides every leaf it covers; the
# name rules decide only the others, and one-letter names b, d, g decide nothing.

LORA_DN = dion3_jax.DimensionNumbers(reduction_axis=0, output_axis=1)


def _dion3_leaves(tx, params) -> set[str]:
    """The leaves whose momentum the Dion3 branch of ``tx.init(params)`` holds."""
    inner = tx.init(params).inner_states["dion3"].inner_state[0]
    flat = jax.tree_util.tree_flatten_with_path(inner.momentum)[0]   # MaskedNodes: no leaves
    return {jax.tree_util.keystr(p) for p, _ in flat}


def test_declared_lora_pair_both_go_to_dion3():
    """The issue's LoRA pair: ``B`` was sent to AdamW by the name rule ``b`` despite its
    declared DimensionNumbers."""
    rng = np.random.default_rng(0)
    params = {"lora": {"A": _normal(rng, (64, 8)), "B": _normal(rng, (8, 64))}}
    dims = {"lora": {"A": LORA_DN, "B": LORA_DN}}
    table = dion3_jax.routing_table(params, dimension_numbers=dims)
    assert table in (pathlib.Path(__file__).parents[1] / "docs" / "ROUTING.md").read_text()
    rows = _table_rows(table)
    assert rows["['lora']['A']"] == ["(64, 8)", "dion3", "1 × 8×64", "dimension_numbers"]
    assert rows["['lora']['B']"] == ["(8, 64)", "dion3", "1 × 64×8", "dimension_numbers"]
    tx = dion3_jax.dion3(0.02, 0.5, weight_decay=0.0, dimension_numbers=dims)
    assert _dion3_leaves(tx, params) == {"['lora']['A']", "['lora']['B']"}


@pytest.mark.slow
def test_declared_lora_factor_gets_the_dion3_update():
    rng = np.random.default_rng(0)
    params = {"lora": {"A": _normal(rng, (64, 8)), "B": _normal(rng, (8, 64))}}
    tx = dion3_jax.dion3(0.02, 0.5, weight_decay=0.0,
                         dimension_numbers={"lora": {"A": LORA_DN, "B": LORA_DN}})
    grads = _like(params, 1)
    upd = jax.jit(tx.update)(grads, tx.init(params), params)[0]
    direct = dion3_jax.scale_by_dion3(0.5)                 # B alone, as a matrix
    want = jax.jit(direct.update)({"B": grads["lora"]["B"]},
                                  direct.init({"B": params["lora"]["B"]}))[0]
    np.testing.assert_allclose(upd["lora"]["B"], -0.02 * want["B"], rtol=1e-5, atol=1e-8)


def test_undeclared_one_letter_names_are_refused_in_one_message():
    params = {"lora": {"A": jnp.ones((64, 8)), "B": jnp.ones((8, 64))},
              "ssm": {"D": jnp.ones((4, 16)), "g": jnp.ones((3, 16)), "b": jnp.ones((16,))},
              "w": jnp.ones((16, 16))}
    with pytest.raises(ValueError) as table_err:
        dion3_jax.routing_table(params)
    with pytest.raises(ValueError) as init_err:
        dion3_jax.dion3(0.02).init(params)
    msg = str(init_err.value)
    assert msg == str(table_err.value)
    for leaf in ("['lora']['B']  shape=(8, 64)", "['ssm']['D']  shape=(4, 16)",
                 "['ssm']['g']  shape=(3, 16)"):
        assert leaf in msg
    assert "['lora']['A']" not in msg and "['ssm']['b']" not in msg and "['w']" not in msg
    # the message's two fixes, as it prints them
    assert "dimension_numbers={'lora': {'B': dion3_jax.DimensionNumbers(" in msg
    assert 'DEFAULT_VECTOR_PATTERN + "|b|d|g"' in msg
    dims = {"lora": {"B": LORA_DN}, "ssm": {"D": None, "g": None}}
    labels = dion3_jax.default_param_labels(params, dims)
    assert labels == {"lora": {"A": "dion3", "B": "dion3"}, "w": "dion3",
                      "ssm": {"D": "scalar", "g": "scalar", "b": "scalar"}}
    vectors = dion3_jax.default_param_labels(
        {"ssm": params["ssm"]},
        vector_pattern=dion3_jax.routing.DEFAULT_VECTOR_PATTERN + "|b|d|g")
    assert vectors == {"ssm": {"D": "scalar", "g": "scalar", "b": "scalar"}}


@pytest.mark.parametrize("dims,want", [
    # optax Muon's "prefix None and dim_nums": a prefix decides every leaf under it
    (lambda dn: {"w1": dn, "w2": None},
     {"w1": {"a": "dion3", "b": "dion3"}, "w2": {"a": "scalar", "b": "scalar"}}),
    # "prefix None, full dim_nums"
    (lambda dn: {"w1": None, "w2": {"a": dn, "b": None}},
     {"w1": {"a": "scalar", "b": "scalar"}, "w2": {"a": "dion3", "b": "scalar"}}),
    # the same prefix tree, as a callable
    (lambda dn: lambda p: {"w1": dn, "w2": None},
     {"w1": {"a": "dion3", "b": "dion3"}, "w2": {"a": "scalar", "b": "scalar"}}),
], ids=["prefix_none_and_dim_nums", "prefix_none_full_dim_nums", "callable"])
def test_prefix_trees_decide_every_leaf_under_them(dims, want):
    params = {"w1": {"a": jnp.ones((2, 3)), "b": jnp.ones((2, 3))},
              "w2": {"a": jnp.ones((2, 3)), "b": jnp.ones((2, 3))}}
    dims = dims(dion3_jax.DimensionNumbers())
    assert dion3_jax.default_param_labels(params, dims) == want
    tx = dion3_jax.dion3(0.02, dimension_numbers=dims)
    held = {f"['{k}']['{j}']" for k, sub in want.items() for j, lab in sub.items()
            if lab == "dion3"}
    assert _dion3_leaves(tx, params) == held


def test_declarations_override_names_and_the_rest_keep_the_rules():
    params = {"embed": {"embedding": jnp.ones((32, 8))},
              "mlp": {"kernel": jnp.ones((8, 16)), "bias": jnp.ones((16,))},
              "gate": {"bias": jnp.ones((4, 16))},
              "lora": {"A": jnp.ones((8, 4)), "B": jnp.ones((4, 8))}}
    dims = {"embed": LORA_DN, "gate": LORA_DN, "lora": {"B": LORA_DN}}
    rows = _table_rows(dion3_jax.routing_table(params, dimension_numbers=dims))
    assert rows["['embed']['embedding']"][1:] == [
        "dion3", "1 × 8×32", "dimension_numbers over embedding/head name 'embed'"]
    assert rows["['gate']['bias']"][1:] == [
        "dion3", "1 × 16×4", "dimension_numbers over vector name 'bias'"]
    # leaves the tree leaves out: the name rules, as with no tree at all
    assert rows["['lora']['A']"][1:] == ["dion3", "1 × 4×8", "matrix"]
    assert rows["['mlp']['kernel']"][1:] == ["dion3", "1 × 16×8", "matrix"]
    assert rows["['mlp']['bias']"][1:] == ["scalar", "-", "rank 1"]
    tx = dion3_jax.dion3(0.02, dimension_numbers=dims)
    assert _dion3_leaves(tx, params) == {
        "['embed']['embedding']", "['gate']['bias']", "['lora']['A']", "['lora']['B']",
        "['mlp']['kernel']"}


def test_declared_vectors_are_refused():
    params = {"blocks": {"kernel": jnp.ones((3, 8, 16)), "bias": jnp.ones((16,)),
                         "scale": jnp.ones((8,))}, "head": {"kernel": jnp.ones((8, 4))}}
    with pytest.raises(ValueError) as err:
        dion3_jax.dion3(0.02, dimension_numbers={"blocks": STACKED, "head": None}).init(params)
    msg = str(err.value)
    assert "['blocks']['bias']  shape=(16,)" in msg and "['blocks']['scale']  shape=(8,)" in msg
    assert "kernel" not in msg and "Give these None" in msg
    # one DimensionNumbers for all leaves is a view: the rules still route the vectors
    labels = dion3_jax.default_param_labels(params, STACKED)
    assert labels["blocks"] == {"kernel": "dion3", "bias": "scalar", "scale": "scalar"}


def test_declared_auto_named_layers_are_not_refused_for_the_head():
    params = jax.eval_shape(LinenMLP().init, jax.random.key(0), jnp.ones((2, 8)))  # shapes
    kernels = {k: {"kernel": LORA_DN} for k in ("Dense_0", "Dense_1", "Dense_2")}
    labels = dion3_jax.default_param_labels(params, {"params": kernels})["params"]
    assert [labels[k]["kernel"] for k in ("Dense_0", "Dense_1", "Dense_2")] == [
        "dion3", "dion3", "dion3"]                       # the user said so: no head check
    assert labels["Dense_0"]["bias"] == "scalar"         # left out of the tree: rank 1
    # a tree that declares only the hidden layers leaves the head to the rules: refused
    with pytest.raises(ValueError, match=r"\['params'\]\['Dense_2'\]\['kernel'\]"):
        dion3_jax.default_param_labels(
            params, {"params": {"Dense_0": {"kernel": LORA_DN}, "Dense_1": {"kernel": LORA_DN}}})
