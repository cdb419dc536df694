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
"""The public ``Orthogonalizer`` record and the step's private ``PolarOperator`` protocol."""

from __future__ import annotations

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dion3_jax
from dion3_jax._polar_operator import BuiltinPolar, CallablePolar, as_polar_operator
from seeds import module_seed

#: Fresh random inputs per run, printed with every test (tests/seeds.py).
SEED = module_seed()

#: What the step calls; the public record has none of it.
PROTOCOL = ("stacked", "of_normalized", "padded_shape", "takes_norms", "any_orientation",
            "input_dtype")


def test_the_record_holds_exactly_polars_keyword_options():
    """Same names, same defaults: a keyword added to ``polar`` must be added to the record."""
    polar_kw = {n: p.default for n, p in inspect.signature(dion3_jax.polar).parameters.items()
                if p.kind is p.KEYWORD_ONLY}
    fields = {f.name: f.default for f in dataclasses.fields(dion3_jax.Orthogonalizer)}
    assert fields == polar_kw


def test_the_record_is_plain_frozen_and_hashable():
    orth = dion3_jax.make_orthogonalizer(coefficients=[[3.0, -4.0, 2.0]] * 4, restarts=[1],
                                         compute_dtype=jnp.float32)
    assert orth.coefficients == ((3.0, -4.0, 2.0),) * 4 and orth.restarts == (1,)
    assert orth.compute_dtype == np.dtype("float32")
    same = dion3_jax.make_orthogonalizer(coefficients=(((3.0, -4.0, 2.0),) * 4), restarts=(1,),
                                         compute_dtype="float32")
    assert orth == same and hash(orth) == hash(same)
    assert orth != dataclasses.replace(same, eps=1e-6)
    with pytest.raises(dataclasses.FrozenInstanceError):
        orth.eps = 1.0
    assert not [a for a in PROTOCOL if hasattr(orth, a)]


def test_direct_construction_is_validated_too():
    with pytest.raises(ValueError, match="restarts"):
        dion3_jax.Orthogonalizer(restarts=(7,))
    with pytest.raises(ValueError, match="compute_dtype"):
        dataclasses.replace(dion3_jax.make_orthogonalizer(), compute_dtype=jnp.int32)


def test_calling_the_record_is_polar_with_its_options():
    x = jnp.asarray(np.random.default_rng(SEED).standard_normal((2, 16, 40)), jnp.float32)
    opts = dict(method="standard", coefficients="jordan", backend="xla", out_dtype=jnp.float32)
    got = jax.jit(dion3_jax.make_orthogonalizer(**opts))(x)
    want = jax.jit(lambda x: dion3_jax.polar(x, **opts))(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_as_polar_operator():
    record = dion3_jax.make_orthogonalizer(method="gram", compute_dtype=jnp.bfloat16, eps=1e-5)
    op = as_polar_operator(record)
    assert isinstance(op, BuiltinPolar) and op.options is record
    assert op.takes_norms and op.any_orientation
    assert op.input_dtype == jnp.bfloat16 and op.eps == 1e-5
    default = as_polar_operator(None)
    assert isinstance(default, BuiltinPolar)
    assert default.options == dion3_jax.Orthogonalizer(out_dtype=jnp.float16)
    assert default.input_dtype == jnp.float16

    def fn(x):
        return x

    user = as_polar_operator(fn)
    assert isinstance(user, CallablePolar) and user.fn is fn
    assert not user.takes_norms and not user.any_orientation
    assert user.padded_shape((3, 5, 7)) == (5, 7)
    with pytest.raises(TypeError, match="orthogonalizer=3"):
        as_polar_operator(3)
