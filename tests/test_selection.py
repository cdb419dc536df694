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
"""Row-selection helpers (dion3_jax._selection) against NumPy, on fresh random inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dion3_jax import _norms, _selection
from seeds import module_seed

#: Fresh random inputs per run, printed with every test (tests/seeds.py).
SEED = module_seed()


def _random_picks(rng, batch, n, k, pad):
    """Distinct row indices per batch element; ``pad`` of them out of range (padding)."""
    idx = np.stack([rng.permutation(n)[:k] for _ in range(batch)])
    idx[:, k - pad:] = n + np.arange(pad)  # Distinct out-of-range indices, as the step pads.
    return idx


@pytest.mark.parametrize("row_axis", [1, 2])
@pytest.mark.parametrize("with_base", [False, True])
def test_expand_rows_equals_scatter_rows(row_axis, with_base):
    rng = np.random.default_rng(SEED)
    batch, n, c, k, pad = 3, 37, 5, 11, 2
    shape = (batch, n, c) if row_axis == 1 else (batch, c, n)
    rshape = (batch, k, c) if row_axis == 1 else (batch, c, k)
    base = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    rows = jnp.asarray(rng.standard_normal(rshape), jnp.float32)
    idx = jnp.asarray(_random_picks(rng, batch, n, k, pad), jnp.int32)
    pos = _selection.row_positions(idx, n)
    got = _selection.expand_rows(rows, pos, row_axis, base=base if with_base else None)
    start = base if with_base else jnp.zeros(shape, jnp.float32)
    want = _selection.scatter_rows(start, idx, rows, row_axis, mode="drop")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # And against NumPy directly.
    ref = np.array(start)
    for b in range(batch):
        for j, r in enumerate(np.asarray(idx[b])):
            if r < n:
                if row_axis == 1:
                    ref[b, r] = np.asarray(rows)[b, j]
                else:
                    ref[b, :, r] = np.asarray(rows)[b, :, j]
    np.testing.assert_array_equal(np.asarray(got), ref)


def test_row_positions():
    rng = np.random.default_rng(SEED)
    idx = _random_picks(rng, 2, 20, 7, 1)
    pos = np.asarray(_selection.row_positions(jnp.asarray(idx), 20))
    for b in range(2):
        expected = np.full(20, 7)
        for j, r in enumerate(idx[b]):
            if r < 20:
                expected[r] = j
        np.testing.assert_array_equal(pos[b], expected)


def test_batched_top_rows_equals_one_call_each():
    rng = np.random.default_rng(SEED)
    requests = [(jnp.asarray(rng.standard_normal((b, n)), jnp.float32), k)
                for b, n, k in [(2, 50, 7), (1, 50, 7), (3, 40, 7), (4, 50, 9), (1, 50, 7)]]
    got = _selection.batched_top_rows(requests)
    for (scores, k), g in zip(requests, got):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(_selection.top_rows(scores, k)))
        top = np.sort(np.argsort(-np.asarray(scores), axis=1, kind="stable")[:, :k], axis=1)
        np.testing.assert_array_equal(np.sort(np.asarray(g), axis=1), top)


def test_batched_top_rows_traces_one_top_k_per_shape():
    requests = [(jnp.ones((2, 50)), 7), (jnp.ones((1, 50)), 7), (jnp.ones((3, 40)), 7)]
    jaxpr = jax.make_jaxpr(lambda r: _selection.batched_top_rows(
        [(s, k) for s, (_, k) in zip(r, requests)]))([s for s, _ in requests])
    assert str(jaxpr).count("top_k") == 2


@pytest.mark.parametrize("scale", [1.0, 1e25])
def test_selected_norm_is_the_payload_frobenius_norm(scale):
    """√(Σ_{i∈I} ‖M_i‖²) (row statistics) = ‖M[I]‖_F (the gathered rows), either row axis,
    also where the squares overflow float32."""
    rng = np.random.default_rng(SEED)
    for row_axis in (1, 2):
        m = (rng.standard_normal((3, 7, 11)) * scale).astype(np.float32)
        rows = np.sort(rng.permutation(m.shape[row_axis])[:4])[None].repeat(3, 0)
        sq = _selection.selected_sq_sum(_selection.row_sq_sums(jnp.asarray(m), row_axis),
                                        jnp.asarray(rows))
        got = _norms.norm_from_sq_sum(sq)
        sel = np.take_along_axis(m.astype(np.float64), np.expand_dims(rows, 3 - row_axis),
                                 axis=row_axis)
        np.testing.assert_allclose(np.asarray(got), np.sqrt(np.sum(sel ** 2, axis=(1, 2))),
                                   rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["gram", "standard"])
def test_payload_norms_from_row_statistics_same_update(method, monkeypatch):
    """One device, f = 1/4: with the built-in orthogonalizer the step takes each selected payload's
    Frobenius norm from row statistics (selected_sq_sum, traced once per batch of same-shape
    blocks); a plain callable doing the same polar normalizes the payload itself (no call), and the
    update is the same to float32 rounding."""
    import dion3_jax
    calls = []
    real = _selection.selected_sq_sum
    monkeypatch.setattr(_selection, "selected_sq_sum",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    rng = np.random.default_rng(SEED)
    shapes = {"a": (16, 40), "b": (16, 40), "c": (40, 16), "heads": (16, 24), "d": (8, 4)}
    params = {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in shapes.items()}
    grads = {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in shapes.items()}
    polar_kw = dict(method=method, compute_dtype=jnp.float32, backend="xla")
    heads = {"heads": 3, "a": None, "b": None, "c": None, "d": None}
    results = {}
    for name, orth in (("built-in", dion3_jax.make_orthogonalizer(**polar_kw)),
                       ("callable", lambda x: dion3_jax.polar(x, **polar_kw))):
        tx = dion3_jax.scale_by_dion3(0.25, orthogonalizer=orth, num_heads=heads)
        calls.clear()
        with jax.default_matmul_precision("highest"):
            results[name], _ = jax.jit(tx.update)(grads, tx.init(params))
        assert (len(calls) > 0) == (name == "built-in"), (name, calls)
    # The two norms differ in float32 summation order (row sums, then their sum, against one
    # sum over the payload); five Newton-Schulz steps amplify that ulp: up to 2.5e-5 seen on
    # fresh inputs. A wrong norm or misplaced row is O(0.1) off.
    for k in shapes:
        np.testing.assert_allclose(np.asarray(results["built-in"][k]),
                                   np.asarray(results["callable"][k]), rtol=0, atol=1e-4,
                                   err_msg=k)


def test_a_sum_in_value_order_does_not_depend_on_the_terms_order():
    """``total_in_value_order`` gives the same bits for any order of the same terms (a mesh
    under global scope holds the selected rows' sums in another order than one device). A
    plain float32 sum of the same terms changes its last bit with their order."""
    rng = np.random.default_rng(SEED)
    x = (rng.standard_normal((3, 1000)) ** 2 * 10.0 ** rng.uniform(-3, 3, (3, 1000))
         ).astype(np.float32)
    in_order = jax.jit(lambda v: _norms.total_in_value_order(v, 1))
    plain = jax.jit(lambda v: jnp.sum(v, axis=1))
    ref = np.asarray(in_order(x))
    plain_moved = False
    for _ in range(8):
        perm = np.stack([rng.permutation(x.shape[1]) for _ in range(x.shape[0])])
        y = np.take_along_axis(x, perm, axis=1)
        np.testing.assert_array_equal(np.asarray(in_order(y)), ref)
        plain_moved |= not np.array_equal(np.asarray(plain(y)), np.asarray(plain(x)))
    print("plain reduce depends on the shard here:", plain_moved)
    np.testing.assert_allclose(ref, x.astype(np.float64).sum(1), rtol=1e-5)


@pytest.mark.parametrize("shape,axis", [((64, 128), 0), ((128, 48), 1)])
def test_a_sum_in_fixed_order_does_not_depend_on_the_shard(shape, axis):
    """``sq_sum_in_fixed_order`` of each row of a matrix (a line along ``axis``: 64 entries,
    or 48 padded to 64) has the same bits whether the whole matrix or one of its 8 shards
    across the rows is summed, each jitted alone, as a mesh under global scope and one
    device sum them; within the tree's rounding, ``(log2 64 + 1)`` half ulps (the square
    and six levels of adds), of the float64 sum. ``selected_row_sq_sums`` of gathered rows
    has those bits too. (XLA's plain reduce, ``_norms.sq_sum``, of the shards differed from
    the whole matrix's in some row's last bit in every draw seen on one CPU; whether it does
    depends on the CPU, so it is printed, not asserted.)"""
    rng = np.random.default_rng(SEED)
    fixed = jax.jit(lambda m: _norms.sq_sum_in_fixed_order(m, axis))
    plain = jax.jit(lambda m: _norms.sq_sum(m, axis))
    picked = jax.jit(lambda m, rows: _selection.selected_row_sq_sums(m, rows, 2 - axis))
    plain_moved = False
    for _ in range(4):
        m = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-2, 2, shape)).astype(np.float32)
        shards = np.split(m, 8, axis=1 - axis)
        whole = np.asarray(fixed(m))
        np.testing.assert_array_equal(np.concatenate([fixed(x) for x in shards]), whole)
        ref = np.sum(np.square(m.astype(np.float64) * 2.0 ** -32), axis=axis)
        np.testing.assert_allclose(whole, ref, rtol=7 * 2.0 ** -24, atol=0)
        plain_moved |= not np.array_equal(np.concatenate([plain(x) for x in shards]),
                                          np.asarray(plain(m)))
        rows = np.sort(rng.permutation(m.shape[1 - axis])[:16])
        np.testing.assert_array_equal(np.asarray(picked(m[None], rows[None]))[0], whole[rows])
    print("plain reduce depends on the shard here:", plain_moved)
