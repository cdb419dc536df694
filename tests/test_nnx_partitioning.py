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
"""``nnx.Optimizer`` with Dion3 on a Flax NNX model sharded by ``nnx.with_partitioning``.

The kernels carry logical axis names, mapped to mesh axes by MaxText-like rules (``RULES``,
handed to Flax as each Variable's ``sharding_rules``). ``nnx.Optimizer`` rebuilds every state
leaf as a Variable with its parameter's metadata and shards it eagerly: Dion3's per-row state
(second moments and row factors, the reduction axes of size 1) must carry that metadata less the
reduction axes' names, else a kernel sharded along its input axis cannot be built
(``dion3_jax/_param_metadata.py``). The model has attention, an MLP and a mixture-of-experts
layer (an expert-stacked ``(E, d, ffn)`` kernel) on a ("fsdp", "tp", "expert") mesh of the 8
simulated CPU devices (tests/conftest.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec as P
import numpy as np
import optax
from flax import nnx
import pytest

import dion3_jax
from seeds import module_seed
from test_compiles_once import counted_compiles

SEED = module_seed()

MESH = {"fsdp": 2, "tp": 2, "expert": 2}
# Logical axis → mesh axis, as MaxText's rules map them: kernels are FSDP × TP tiles, expert
# stacks experts × FSDP × TP.
RULES = {"embed": "fsdp", "mlp": "tp", "heads": "tp", "vocab": "tp", "exp": "expert"}

D, HEADS, FFN, EXPERTS, VOCAB, SEQ, BATCH = 32, 4, 64, 4, 64, 8, 4
POLAR32 = dion3_jax.make_orthogonalizer(method="standard", compute_dtype=jnp.float32)

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")


def mesh_axis(names: tuple) -> P:
    """The mesh axes that ``RULES`` gives the logical ``names`` (what Flax computes)."""
    return P(*(RULES.get(n) if n is not None else None for n in names))


def partitioned(*names):
    """A lecun-normal initializer whose Variable carries the logical ``names`` and ``RULES``."""
    return nnx.with_partitioning(nnx.initializers.lecun_normal(), names,
                                 sharding_rules=tuple(RULES.items()))


def gathered(w):
    """FSDP: the forward pass uses the whole (all-gathered) weight."""
    return jax.sharding.reshard(w, P())


def dense(x, layer):
    return x @ gathered(layer.kernel[...])


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        def linear(i, o, names):
            return nnx.Linear(i, o, use_bias=False, kernel_init=partitioned(*names), rngs=rngs)
        self.embed = nnx.Embed(VOCAB, D, embedding_init=partitioned("vocab", "embed"),
                               rngs=rngs)
        self.query, self.key, self.value = (linear(D, D, ("embed", "heads")) for _ in range(3))
        self.out = linear(D, D, ("heads", "embed"))
        self.mlp_in = linear(D, FFN, ("embed", "mlp"))
        self.mlp_out = linear(FFN, D, ("mlp", "embed"))
        self.router = linear(D, EXPERTS, ("embed", None))
        self.experts_in = nnx.Param(partitioned("exp", "embed", "mlp")(rngs.params(),
                                                                      (EXPERTS, D, FFN)))
        self.experts_out = nnx.Param(partitioned("exp", "mlp", "embed")(rngs.params(),
                                                                       (EXPERTS, FFN, D)))
        self.lm_head = linear(D, VOCAB, ("embed", "vocab"))

    def attention(self, h):
        split = lambda t: t.reshape(*t.shape[:-1], HEADS, D // HEADS)  # noqa: E731
        q, k, v = (split(dense(h, m)) for m in (self.query, self.key, self.value))
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D // HEADS)
        mask = jnp.tril(jnp.ones((h.shape[1], h.shape[1]), bool))
        probs = jax.nn.softmax(jnp.where(mask, logits, -1e9), axis=-1)
        return dense(jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(h.shape), self.out)

    def moe(self, h):
        gates = jax.nn.softmax(dense(h, self.router), axis=-1)
        up = jax.nn.gelu(jnp.einsum("bsd,edf->bsef", h, gathered(self.experts_in[...])))
        return jnp.einsum("bsef,efd,bse->bsd", up, gathered(self.experts_out[...]), gates)

    def __call__(self, tokens):
        h = gathered(self.embed.embedding[...])[tokens]
        h = h + self.attention(h)
        h = h + dense(jax.nn.gelu(dense(h, self.mlp_in)), self.mlp_out)
        h = h + self.moe(h)
        return dense(h, self.lm_head)


def make_tx(orthogonalizer=None):
    # "global" selection: row-sharded kernels select like one device (an exact comparison).
    return dion3_jax.dion3(
        0.02, 0.25, adam_learning_rate=3e-3, orthogonalizer=orthogonalizer,
        dimension_numbers=dion3_jax.DimensionNumbers(reduction_axis=-2, output_axis=-1),
        mesh_options=dion3_jax.MeshOptions(selection_scope="global"))


def loss_fn(model, tokens):
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


@nnx.jit
def train_step(model, optimizer, tokens):
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
    updates = optimizer.update(model, grads)
    return loss, grads, updates


def specs(tree) -> dict:
    """Each leaf's PartitionSpec (its committed sharding), by path."""
    return {jax.tree_util.keystr(p): x.sharding.spec
            for p, x in jax.tree_util.tree_flatten_with_path(nnx.as_pure(tree))[0]
            if getattr(x, "ndim", 0)}


def dion3_node(opt_state):
    return nnx.as_pure(opt_state).inner_states["dion3"].inner_state[0]


def host(tree):
    return jax.tree.map(np.asarray, nnx.as_pure(tree))


def make_mesh():
    return jax.make_mesh(tuple(MESH.values()), tuple(MESH), devices=jax.devices()[:8],
                         axis_types=(AxisType.Explicit,) * len(MESH))


def test_optimizer_state_keeps_the_output_axes_sharding():
    """``nnx.Optimizer`` builds; the per-row state's Variables name the parameter's output axes
    only: placed and described (``nnx.get_partition_spec``) like the parameter less its
    reduction axes, the momentum exactly like the parameter."""
    with jax.set_mesh(make_mesh()):
        model = Model(nnx.Rngs(SEED))
        optimizer = nnx.Optimizer(model, make_tx(), wrt=nnx.Param)
        described = nnx.get_partition_spec(nnx.state(optimizer))["opt_state"]
    params, node = nnx.as_pure(nnx.state(model, nnx.Param)), dion3_node(optimizer.opt_state)
    described = described["inner_states"]["dion3"]["inner_state"][0]
    for name, names in (("query", ("embed", "heads")), ("out", ("heads", "embed")),
                        ("experts_in", ("exp", "embed", "mlp")),
                        ("experts_out", ("exp", "mlp", "embed"))):
        def get(tree, name=name):
            return tree[name] if name.startswith("experts") else tree[name]["kernel"]
        whole, row = mesh_axis(names), mesh_axis(names[:-2] + (None, names[-1]))
        assert get(params).sharding.spec == whole, name
        assert get(node.momentum).sharding.spec == whole, name
        for leaf in (node.variance, node.momentum_scale):
            assert get(leaf).sharding.spec == row, name
        assert (get(described.momentum), get(described.variance)) == (whole, row), name


class Bfloat16Model(nnx.Module):
    """A bfloat16 MLP kernel and expert stack, partitioned like ``Model``'s."""

    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(D, FFN, use_bias=False, param_dtype=jnp.bfloat16,
                             kernel_init=partitioned("embed", "mlp"), rngs=rngs)
        self.experts = nnx.Param(partitioned("exp", "mlp", "embed")(
            rngs.params(), (EXPERTS, FFN, D), jnp.bfloat16))

    def __call__(self, x):
        h = jax.nn.gelu(dense(x, self.up))
        return jnp.einsum("bf,efd->bd", h, gathered(self.experts[...])).astype(jnp.float32)


@pytest.mark.slow  # the fast loop keeps the float32 model's sharding test above
def test_bfloat16_kernels_get_a_float16_momentum_and_unsharded_bounds():
    """bfloat16 kernels under ``nnx.with_partitioning``: their default float16 momentum is
    sharded like the kernel, and its storage bounds (one scalar per kernel) are Variables with
    an empty partition spec, so ``nnx.Optimizer`` builds and a jitted step runs, writing
    positive bounds."""
    x = jnp.asarray(np.random.default_rng(SEED).standard_normal((BATCH, D)), jnp.bfloat16)
    with jax.set_mesh(make_mesh()):
        model = Bfloat16Model(nnx.Rngs(SEED))
        optimizer = nnx.Optimizer(model, make_tx(), wrt=nnx.Param)
        described = nnx.get_partition_spec(nnx.state(optimizer))["opt_state"]
        described = described["inner_states"]["dion3"]["inner_state"][0]

        @nnx.jit
        def step(model, optimizer):
            grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model)
            optimizer.update(model, grads)

        step(model, optimizer)
    node = dion3_node(optimizer.opt_state)
    for get, names in ((lambda t: t["up"]["kernel"], ("embed", "mlp")),
                       (lambda t: t["experts"], ("exp", "mlp", "embed"))):
        assert get(node.momentum).dtype == jnp.float16
        assert get(node.momentum).sharding.spec == mesh_axis(names)
        assert get(described.momentum_bound) == P()
        assert float(get(node.momentum_bound)) > 0
    assert model.up.kernel[...].dtype == jnp.bfloat16


@pytest.mark.slow
@pytest.mark.parametrize("orthogonalizer,tol", [(POLAR32, 1e-5), (None, 5e-3)],
                         ids=["float32-polar", "float16-polar"])
def test_nnx_optimizer_trains_a_partitioned_model(orthogonalizer, tol):
    """Trains 4 steps compiling once, keeps every sharding, and its 4th update equals the
    single-device update of the same state and gradients (relative to the update's largest
    entry: float32 polar < 1e-5 (measured 1.8e-6), float16 polar < 5e-3 (2.5e-3), its own
    rounding)."""
    tokens = jnp.asarray(np.random.default_rng(SEED).integers(0, VOCAB, (BATCH, SEQ + 1)))
    with jax.set_mesh(make_mesh()):
        model = Model(nnx.Rngs(SEED))
        optimizer = nnx.Optimizer(model, make_tx(orthogonalizer), wrt=nnx.Param)
        param_specs, state_specs = specs(nnx.state(model)), specs(optimizer.opt_state)
        losses = [float(train_step(model, optimizer, tokens)[0])]
        with counted_compiles() as compiles:
            for _ in range(2):
                losses.append(float(train_step(model, optimizer, tokens)[0]))
            before = host((nnx.state(model, nnx.Param), optimizer.opt_state))
            loss, grads, updates = train_step(model, optimizer, tokens)
            losses.append(float(loss))
        assert len(compiles) == 0
        assert specs(nnx.state(model)) == param_specs
        assert specs(optimizer.opt_state) == state_specs
    print("losses", losses)
    assert np.isfinite(losses).all() and losses[-1] < losses[0]

    params, opt_state = before
    tx = make_tx(orthogonalizer)   # no mesh: one device
    want = jax.tree_util.tree_leaves_with_path(jax.jit(tx.update)(host(grads), opt_state,
                                                                  params)[0])
    got = jax.tree_util.tree_leaves_with_path(host(updates))
    assert [p for p, _ in got] == [p for p, _ in want]
    for (path, g), (_, w) in zip(got, want):
        err = np.max(np.abs(g - w)) / np.max(np.abs(w))
        print(jax.tree_util.keystr(path), f"{err:.2g}")
        assert err < tol, jax.tree_util.keystr(path)
