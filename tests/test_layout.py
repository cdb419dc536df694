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
"""Leaf ↔ canonical block views and per-leaf option lookup."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dion3_jax import DimensionNumbers
from dion3_jax import _layout


@pytest.mark.parametrize("shape,dn,heads,splits", [
    ((6, 10), None, None, None),
    ((10, 6), DimensionNumbers(1, 0), None, None),
    ((3, 6, 10), None, None, None),
    ((4, 3, 6, 10), DimensionNumbers((0, 2), 3), None, None),
    ((2, 6, 12), DimensionNumbers(1, 2), 3, None),
    ((12, 6), DimensionNumbers(1, 0), 4, None),
    ((6, 16), None, None, (8, 4, 4)),
    ((16, 6), DimensionNumbers(1, 0), None, (10, 6)),
    ((6, 5, 4), DimensionNumbers(0, (1, 2)), None, None),
])
def test_round_trip_and_block_shapes(shape, dn, heads, splits):
    lay = _layout.make_layout(shape, dn, heads, splits)
    x = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)
    blocks = lay.to_blocks(x)
    assert [b.shape for b in blocks] == [bl.shape for bl in lay.blocks]
    np.testing.assert_array_equal(lay.from_blocks(blocks, shape), x)
    v = jnp.ones(lay.variance_shape)
    vb = lay.to_blocks(v)
    for b, bl in zip(vb, lay.blocks):
        assert b.shape[bl.row_axis] == bl.n and b.shape[3 - bl.row_axis] == 1
    assert lay.from_blocks(vb, lay.variance_shape).shape == lay.variance_shape


def test_rows_are_output_neurons():
    # Flax (in, out): row j of the canonical matrix is output column j of the kernel.
    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 8)))
    lay = _layout.make_layout((5, 8), None, 2)
    (b,) = lay.to_blocks(x)
    assert lay.blocks[0].row_axis == 2 and b.shape == (2, 5, 4)
    np.testing.assert_array_equal(b[1, :, 0], x[:, 4])   # head 1, first row = output 4


def test_per_leaf_lookup_prefix_and_masked():
    tree = {"a": {"k": 1, "b": 2}, "c": 3}
    look = _layout.per_leaf({"a": 4, "c": None}, tree)
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    assert [look(p) for p, _ in flat] == [4, 4, None]
    assert _layout.per_leaf((8, 8), tree)(flat[0][0]) == (8, 8)
    assert _layout.per_leaf([8, 8], tree)(flat[0][0]) == [8, 8]
    fn = _layout.per_leaf(lambda t: jax.tree.map(lambda _: 2, t), tree)
    assert fn(flat[2][0]) == 2
