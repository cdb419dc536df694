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
"""Complex parameters: Dion3 orthogonalizes real matrices only.

A complex leaf of rank < 2, or one that the user sends to the scalar optimizer (``None`` in a
``dimension_numbers`` tree, a ``"scalar"`` label, a vector name), gets optax's AdamW or Lion,
which take complex leaves. A complex leaf headed for Dion3 is refused at ``init`` (and by
``routing_table``) with one ``ValueError`` that names every such leaf and its dtype, whichever
way it was headed there: the name rules, a declared ``DimensionNumbers``, a ``"dion3"`` label,
or ``scale_by_dion3`` used alone.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dion3_jax

SEED = int(np.random.default_rng().integers(1 << 30))
DN = dion3_jax.DimensionNumbers(reduction_axis=0, output_axis=1)


def _complex(rng, shape):
    return jnp.asarray(rng.standard_normal(shape) + 1j * rng.standard_normal(shape),
                       jnp.complex64)


def _params(seed):
    rng = np.random.default_rng(seed)
    return {"mlp": {"kernel": jnp.asarray(rng.standard_normal((8, 16)), jnp.float32),
                    "bias": _complex(rng, (16,))},
            "z": _complex(rng, (8, 8)), "stack": {"u": _complex(rng, (2, 4, 8))}}


def test_complex_matrices_are_refused_naming_every_one():
    params = _params(SEED)
    with pytest.raises(ValueError) as init_err:
        dion3_jax.dion3(0.01, dimension_numbers=dion3_jax.DimensionNumbers(-2, -1)).init(params)
    with pytest.raises(ValueError) as table_err:
        dion3_jax.routing_table(params, dimension_numbers=dion3_jax.DimensionNumbers(-2, -1))
    msg = str(init_err.value)
    assert msg == str(table_err.value)
    assert "['z']  shape=(8, 8)  (complex64 matrix)" in msg
    assert "['stack']['u']  shape=(2, 4, 8)  (complex64 matrix)" in msg
    assert "bias" not in msg and "kernel" not in msg
    assert "dimension_numbers={'stack': {'u': None}}" in msg   # the fix it prints


def test_declared_and_labeled_complex_matrices_are_refused():
    params = _params(SEED + 1)
    declared = {"z": DN, "stack": None}
    with pytest.raises(ValueError, match=r"\['z'\]  shape=\(8, 8\)  \(complex64 given "):
        dion3_jax.dion3(0.01, dimension_numbers=declared).init(params)
    labels = {"mlp": "dion3", "z": "dion3", "stack": "dion3"}
    labels["mlp"] = {"kernel": "dion3", "bias": "scalar"}
    with pytest.raises(ValueError, match=r"\['stack'\]\['u'\]  shape=\(2, 4, 8\)"):
        dion3_jax.routing_table(params, param_labels=labels)
    with pytest.raises(ValueError) as err:   # init: scale_by_dion3's own check, every leaf
        dion3_jax.dion3(0.01, param_labels=labels).init(params)
    assert "['z'] has dtype complex64" in str(err.value)
    assert "['stack']['u'] has dtype complex64" in str(err.value)
    with pytest.raises(ValueError) as err:
        dion3_jax.scale_by_dion3().init({"a": params["z"], "b": params["mlp"]["kernel"],
                                         "c": params["stack"]["u"]})
    assert "['a'] has dtype complex64, ['c'] has dtype complex64" in str(err.value)


@pytest.mark.parametrize("scalar_optimizer", [
    "adamw", pytest.param("lion", marks=pytest.mark.slow)])
def test_complex_leaves_sent_to_the_scalar_optimizer_get_optaxs_update(scalar_optimizer):
    """The complex vector by rank, the complex matrices by a declared None: their updates are
    optax's for the same leaves; the real matrix still gets Dion3."""
    params = _params(SEED + 2)
    dims = {"z": None, "stack": None}
    rows = dion3_jax.routing_table(params, dimension_numbers=dims)
    assert re.search(r"\['mlp'\]\['kernel'\]\s+\(8, 16\)\s+dion3", rows)
    assert re.search(r"\['z'\]\s+\(8, 8\)\s+scalar", rows)
    tx = dion3_jax.dion3(0.01, dimension_numbers=dims, scalar_optimizer=scalar_optimizer,
                         adam_learning_rate=1e-3)
    rng = np.random.default_rng(SEED + 3)
    grads = {"mlp": {"kernel": jnp.asarray(rng.standard_normal((8, 16)), jnp.float32),
                     "bias": _complex(rng, (16,))},
             "z": _complex(rng, (8, 8)), "stack": {"u": _complex(rng, (2, 4, 8))}}
    state, update = tx.init(params), jax.jit(tx.update)
    got = []
    for _ in range(2):
        u, state = update(grads, state, params)
        got.append(u)
    kw = dict(b1=0.9, b2=0.95, weight_decay=0.0)
    ref = (optax.adamw(1e-3, eps=1e-8, **kw) if scalar_optimizer == "adamw"
           else optax.lion(1e-3, **kw))
    scalars = {"bias": params["mlp"]["bias"], "z": params["z"], "u": params["stack"]["u"]}
    g = {"bias": grads["mlp"]["bias"], "z": grads["z"], "u": grads["stack"]["u"]}
    ref_state = ref.init(scalars)
    for u in got:
        want, ref_state = ref.update(g, ref_state, scalars)
        for name, have in (("bias", u["mlp"]["bias"]), ("z", u["z"]), ("u", u["stack"]["u"])):
            assert have.dtype == jnp.complex64
            np.testing.assert_allclose(have, want[name], rtol=1e-6, atol=1e-9)
        assert float(jnp.abs(u["mlp"]["kernel"]).max()) > 0
