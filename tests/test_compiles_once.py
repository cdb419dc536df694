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
"""A training loop compiles its step once per configuration.

jit keys its cache on whether each argument is committed to a device, and commits its outputs
when any input is committed. So a state whose placement differs from the params' makes the
second step another cache entry: one more compile of the whole step (seconds on a GPU for a
large model). Each loop below starts the way users start: params made with ``jnp`` or an eager
``nnx`` init (uncommitted), placed with ``jax.device_put`` (committed), or sharded over a mesh.
After the first step, nothing compiles again: not the step, and not the eager ops around it.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import dion3_jax

POLAR = {"orthogonalizer": dion3_jax.make_orthogonalizer(backend="xla")}


@contextlib.contextmanager
def counted_compiles():
    """A list that receives one entry per XLA compilation inside the ``with`` block."""
    seen: list[float] = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def _params(rng):
    return {"w": jnp.asarray(rng.standard_normal((16, 32)), jnp.float32),
            "u": jnp.asarray(rng.standard_normal((32, 8)), jnp.float32),
            "b": jnp.zeros((32,))}


def _place(params, placement):
    """``params`` placed as named, and the context the loop runs in (the mesh, if any)."""
    if placement == "uncommitted":
        return params, contextlib.nullcontext()
    if placement == "committed":
        return jax.device_put(params, jax.devices()[0]), contextlib.nullcontext()
    mesh = jax.make_mesh((4,), ("fsdp",), axis_types=(AxisType.Explicit,),
                         devices=jax.devices()[:4])
    specs = {"w": P("fsdp"), "u": P("fsdp"), "b": P()}
    return ({k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()},
            jax.set_mesh(mesh))


def _compiles_after_the_first_step(tx, params, *, donate: bool, steps: int = 3) -> int:
    update = jax.jit(tx.update, donate_argnums=(1,) if donate else ())
    state = tx.init(params)
    rng = np.random.default_rng(1)

    def grad_like(p):   # placed like its param, as a jitted loss's gradient is
        g = jnp.asarray(rng.standard_normal(p.shape), p.dtype)
        return jax.device_put(g, p.sharding) if p.committed else g

    grads = [jax.tree.map(grad_like, params) for _ in range(steps)]
    updates, state = update(grads[0], state, params)
    params = optax.apply_updates(params, updates)
    with counted_compiles() as seen:
        for g in grads[1:]:
            updates, state = update(g, state, params)
            params = optax.apply_updates(params, updates)
        jax.block_until_ready(params)
    return len(seen)


# The fast loop: the README's case (uncommitted params, no donation); the other placements and
# donation run with the slow tests.
@pytest.mark.parametrize("placement,donate", [
    ("uncommitted", False),
    *(pytest.param(p, d, marks=pytest.mark.slow)
      for p, d in [("uncommitted", True), ("committed", False), ("committed", True),
                   ("mesh", False), ("mesh", True)])])
def test_dion3_step_compiles_once(placement, donate):
    params, where = _place(_params(np.random.default_rng(0)), placement)
    with where:
        tx = dion3_jax.dion3(0.02, fraction=0.25, **POLAR)
        assert _compiles_after_the_first_step(tx, params, donate=donate) == 0


@pytest.mark.slow   # the same init as dion3's, through other builders
@pytest.mark.parametrize("make", [
    lambda: dion3_jax.muon(0.02, **POLAR),
    lambda: dion3_jax.normuon(0.02, **POLAR),
    lambda: optax.chain(dion3_jax.scale_by_dion3(fraction=0.5, **POLAR), optax.scale(-0.02)),
], ids=["muon", "normuon", "scale_by_dion3"])
def test_other_entry_points_compile_once_from_uncommitted_params(make):
    params = _params(np.random.default_rng(2))
    del params["b"]         # scale_by_dion3 takes matrices only
    assert _compiles_after_the_first_step(make(), params, donate=False) == 0


@pytest.mark.slow  # checks the counter, not the library
def test_the_step_really_is_compiled_when_placements_change():
    """The counter sees a recompile: feeding a committed state with uncommitted params."""
    params = _params(np.random.default_rng(3))
    tx = dion3_jax.dion3(0.02, fraction=0.25, **POLAR)
    update = jax.jit(tx.update)
    grads = jax.tree.map(jnp.ones_like, params)
    update(grads, tx.init(params), params)
    with counted_compiles() as seen:
        update(grads, jax.device_put(tx.init(params), jax.devices()[0]), params)
    assert len(seen) >= 1


class _MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(16, 64, rngs=rngs)
        self.l2 = nnx.Linear(64, 16, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.gelu(self.l1(x)))


def test_nnx_optimizer_compiles_once_from_an_eager_init():
    """The README's Flax NNX loop: an eager init makes uncommitted params."""
    model = _MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, dion3_jax.dion3(0.02, fraction=0.25, **POLAR),
                              wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: ((m(x) - y) ** 2).mean())(model)
        optimizer.update(model, grads)
        return loss

    x = jax.random.normal(jax.random.key(0), (32, 16))
    losses = [float(train_step(model, optimizer, x, x))]
    with counted_compiles() as seen:
        losses += [float(train_step(model, optimizer, x, x)) for _ in range(2)]
    assert len(seen) == 0
    assert losses[-1] < losses[0]
