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
"""``dion3_jax._megabatch.unstack``: the pieces of a stacked group, and how they reach XLA."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dion3_jax import _megabatch
from seeds import module_seed

#: Fresh random inputs per run, printed with every test (tests/seeds.py).
SEED = module_seed()


@pytest.mark.parametrize("computed_once", [False, True])
def test_unstack_inverts_stack(computed_once):
    rng = np.random.default_rng(SEED)
    sizes = [int(s) for s in rng.integers(1, 4, size=4)]
    parts = [jnp.asarray(rng.standard_normal((s, 3, 5)), jnp.float32) for s in sizes]
    got = jax.jit(lambda x: _megabatch.unstack(x, sizes, computed_once))(
        _megabatch.stack(parts))
    for g, p in zip(got, parts, strict=True):
        np.testing.assert_array_equal(g, p)


def test_computed_once_pieces_share_no_operand():
    """With ``computed_once`` each piece is sliced from its own output of the optimization
    barrier: consumers of different pieces share no operand (XLA:GPU would otherwise merge them
    into one slower multi-output fusion). Without it, the pieces slice ``x`` itself."""
    sizes = [1, 2, 1]
    fn = lambda once: jax.jit(  # noqa: E731
        lambda x: [2 * p for p in _megabatch.unstack(x, sizes, once)])
    x = jnp.ones((4, 8, 8))
    for once, distinct in ((True, 3), (False, 1)):
        text = fn(once).lower(x).as_text()
        sliced = re.findall(r"stablehlo\.dynamic_slice (%[\w#]+),", text)
        assert len(sliced) == 3 and len(set(sliced)) == distinct, (once, sliced)
