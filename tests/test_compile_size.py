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
"""The traced and compiled step does not grow by its per-shape work with every same-shape leaf.

Compile time is a cost of the optimizer (``benchmarks/bench_compile.py``): the selection's sorts
and row scatters run once per batch of same-shape matrices, and the step's per-leaf kernels
are the same program for every leaf of a shape (no per-leaf offsets baked in), so XLA compiles
each once.
"""

from __future__ import annotations

import collections
import re

import jax
import jax.extend
import jax.numpy as jnp
import pytest

import dion3_jax


def _tree(layers: int) -> dict[str, jax.ShapeDtypeStruct]:
    shapes = {}
    for i in range(layers):
        shapes.update({f"l{i}/q": (16, 16), f"l{i}/o": (16, 16), f"l{i}/up": (16, 40),
                       f"l{i}/down": (40, 16)})
    return {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}


def _primitives(fraction: float, layers: int) -> collections.Counter:
    params = _tree(layers)
    tx = dion3_jax.scale_by_dion3(fraction)
    state = jax.eval_shape(tx.init, params)
    counts: collections.Counter = collections.Counter()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            counts[eqn.primitive.name] += 1
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(tx.update)(params, state).jaxpr)
    return counts


def _compiled_ops(fraction: float, layers: int) -> collections.Counter:
    params = _tree(layers)
    tx = dion3_jax.scale_by_dion3(fraction)
    state = jax.eval_shape(tx.init, params)
    hlo = jax.jit(tx.update).lower(params, state).compile().as_text()
    return collections.Counter(re.findall(r"= \S+ (sort|scatter|top[-_]?k)\(", hlo))


@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_sorts_and_scatters_do_not_grow_with_same_shape_leaves(fraction):
    small, large = _primitives(fraction, 2), _primitives(fraction, 6)
    for name in ("sort", "top_k", "scatter", "scatter-add"):
        assert small[name] == large[name], (name, small[name], large[name])
    assert large["top_k"] > 0


@pytest.mark.slow  # ~9 s: two XLA compiles; the jaxpr-level tests above stay in the fast loop
def test_compiled_sorts_do_not_grow_with_same_shape_leaves():
    """From two layers on (with one, XLA merges the payload pass's row-position scatter of a
    shape group with the update's, which is then the same computation)."""
    assert _compiled_ops(0.25, 2) == _compiled_ops(0.25, 3)


def _per_leaf(fraction: float) -> dict[str, float]:
    a, b = _primitives(fraction, 2), _primitives(fraction, 3)
    return {k: (b[k] - a[k]) / 4 for k in set(a) | set(b)}


def test_per_leaf_trace_holds_only_the_leaf_passes():
    """At f = 1/4 an extra same-shape leaf adds its own passes only: two row statistics of M
    (O's row norms run once per batch, over the batch's factors as the polar wrote them, and
    the small per-matrix sums once per batch on its stacked arrays; on the CPU the statistics
    pass's reference), the gather S[I] (in the payload pass) and the gather of the update rows;
    the index work (clamp, keep mask, payload positions) runs once per batch or shape group
    (it was per leaf and per write: 6 reductions, 5 gathers, 4 compares and 3 minima per leaf
    before, then 3 gathers with S gathered back into M). The statistics pass's saturation of
    ``S`` (:func:`pallas_kernels.scaled_sum`) adds one finiteness compare (of the larger
    magnitude), its max and one clamp."""
    per_leaf = _per_leaf(0.25)
    assert per_leaf["reduce_sum"] == 2, per_leaf
    assert per_leaf["gather"] == 2, per_leaf
    assert per_leaf["lt"] == 1 and per_leaf["max"] == 1 and per_leaf["clamp"] == 1, per_leaf
    assert per_leaf.get("min", 0) == 0, per_leaf


def test_per_leaf_trace_is_small():
    """The traced work per extra same-shape leaf (a regression bound with some slack: 48 equations
    per leaf at f = 1/4, 36 at f = 1, with the statistics pass's reference summing a single matrix
    as its 2-D view (so XLA writes ``S`` in place of the momentum); 46 and 34 before, with the
    payload pass given its batches' norms and selected rows stacked and NorMuon's factor row norms
    kept per batch; 50 and 40 when each was sliced per leaf; 53 and 43 with two compares in the
    saturation of ``S``; 44 and 34 with the statistics pass that writes ``S`` and the decay deferred
    to the momentum's row factors; 43 and 30 before it, with the selected rows' payload pass; 40 and
    28 before that; 47 and 34 before the factors' row norms ran per batch; 74 and 40 before the
    per-batch index work, NorMuon statistics and sums)."""
    for fraction, bound in ((0.25, 50), (1.0, 38)):
        a, b = _primitives(fraction, 2), _primitives(fraction, 3)
        per_leaf = (sum(b.values()) - sum(a.values())) / 4
        assert per_leaf <= bound, (fraction, per_leaf)
