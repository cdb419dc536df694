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
"""Stochastic rounding of a 16-bit momentum (``pallas_kernels._stochastic_rounding``,
``dion3_jax._rounding``), against float64.

Each rounding gives one of the two neighbouring 16-bit values, the upper with probability equal
to the distance from the lower (checked per value within 5 standard errors of a binomial mean,
in float64); inf, NaN and the saturation at the dtype's largest value pass through; the random
bits are a function of (seed, step, leaf, write, global element index) only, so a sharded leaf
gets one device's bits; and a never-selected row summed over thousands of steps stays far closer
to its float64 sum than under round-to-nearest.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import dion3_jax
import pallas_kernels
from dion3_jax import _rounding
from pallas_kernels._stochastic_rounding import random_bits, stochastic_round
from seeds import module_seed

#: Fresh random inputs per run, printed with every test (tests/seeds.py).
SEED = module_seed()

DTYPES = [jnp.bfloat16, jnp.float16]
#: Per dtype, the bit patterns of its smallest normal and largest finite magnitude.
NORMAL_MIN = {jnp.bfloat16: 0x0080, jnp.float16: 0x0400}
FINITE_MAX = {jnp.bfloat16: 0x7F7F, jnp.float16: 0x7BFF}


def _as16(bits: np.ndarray, dtype) -> np.ndarray:
    return bits.astype(np.uint16).view(jnp.dtype(dtype).type).astype(np.float64)


def _between(dtype, rng, k: int):
    """``k`` float32 values strictly between two neighbouring ``dtype`` values ``(lo, hi)``
    (``hi`` away from zero; both signs; float16's subnormals included, bfloat16's left out:
    they are float32 subnormals, which some platforms flush), and those neighbours."""
    low = 0 if dtype == jnp.float16 else NORMAL_MIN[dtype]
    mag = rng.integers(low, FINITE_MAX[dtype], k)
    sign = rng.integers(0, 2, k) << 15
    lo, hi = _as16(mag | sign, dtype), _as16((mag + 1) | sign, dtype)
    x = (lo + rng.uniform(0.05, 0.95, k) * (hi - lo)).astype(np.float32)
    return x, lo, hi


@pytest.mark.parametrize("dtype", DTYPES)
def test_rounding_is_unbiased_and_picks_a_neighbour(dtype):
    """4096 roundings of each of 64 values: each result is one of the value's two neighbours,
    and the share of upper ones is ``(x − lo)/(hi − lo)`` (float64) within 5 standard errors."""
    rng = np.random.default_rng(SEED)
    k, n = 64, 4096
    x, lo, hi = _between(dtype, rng, k)
    bits = random_bits(_rounding.step_key(SEED, jnp.int32(0), 0, 0),
                       jax.lax.broadcasted_iota(jnp.uint32, (k, n), 0),
                       jax.lax.broadcasted_iota(jnp.uint32, (k, n), 1))
    y = np.asarray(jax.jit(stochastic_round, static_argnums=1)(
        jnp.broadcast_to(jnp.asarray(x)[:, None], (k, n)), dtype, bits))
    assert y.dtype == jnp.dtype(dtype)
    y = y.astype(np.float64)
    up = y == hi[:, None]
    assert np.all(up | (y == lo[:, None]))
    p = (x.astype(np.float64) - lo) / (hi - lo)
    se = np.sqrt(p * (1 - p) / n)
    np.testing.assert_array_less(np.abs(up.mean(axis=1) - p), 5 * se + 1.0 / n)
    # The mean itself, in units of the gap: the same statement of E[round(x)] = x.
    mean_err = (y.mean(axis=1) - x.astype(np.float64)) / (hi - lo)
    np.testing.assert_array_less(np.abs(mean_err), 5 * se + 1.0 / n)


@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values_and_saturation(dtype):
    """inf, −inf, NaN and ±0 stay; 16-bit values round to themselves whatever the bits;
    magnitudes past the largest finite value saturate there (float16: ±65504), never inf."""
    big = float(jnp.finfo(dtype).max)
    x = jnp.asarray([np.inf, -np.inf, np.nan, 0.0, -0.0, 1.0, -2.5, big, -big, 3.4e38,
                     -3.4e38, 1e5, -1e5], jnp.float32)
    want = np.asarray([np.inf, -np.inf, np.nan, 0.0, -0.0, 1.0, -2.5, big, -big,
                       min(3.4e38, big), -min(3.4e38, big), min(1e5, big), -min(1e5, big)])
    if dtype == jnp.bfloat16:     # 1e5 is no bfloat16 value: check it in the test below
        want[-2:] = np.nan
    for fill in (0, 0xFFFFFFFF):
        y = np.asarray(stochastic_round(x, dtype, jnp.full(x.shape, fill, jnp.uint32)),
                       np.float64)
        exact = ~np.isnan(want)
        exact[2] = False
        np.testing.assert_array_equal(y[exact], want[exact])
        assert np.isnan(y[2])
        np.testing.assert_array_equal(np.signbit(y[3:5]), [False, True])
        assert np.all(np.isfinite(y[3:]))
    rng = np.random.default_rng(SEED)
    v = _as16(rng.integers(0, FINITE_MAX[dtype] + 1, 256) | (rng.integers(0, 2, 256) << 15),
              dtype)
    bits = jnp.asarray(rng.integers(0, 2 ** 32, 256, dtype=np.uint64).astype(np.uint32))
    y = np.asarray(stochastic_round(jnp.asarray(v, jnp.float32), dtype, bits), np.float64)
    np.testing.assert_array_equal(y, v)
    with pytest.raises(ValueError, match="float32"):
        stochastic_round(x, jnp.float32, bits[:1])


def _bits(seed, count, leaf, write, shape, spec=P()):
    return _rounding.momentum_bits(_rounding.step_key(seed, count, leaf, write), shape, spec)


def test_bits_are_keyed_by_step_leaf_and_write():
    """The same (seed, step, leaf, write) gives the same bits, jitted or not; another step,
    leaf, write or seed gives others (equal 32-bit words: about 2⁻³² of them)."""
    shape = (8, 3, 16)
    base = np.asarray(_bits(SEED, jnp.int32(5), 2, _rounding.SUM, shape))
    again = jax.jit(lambda c: _bits(SEED, c, 2, _rounding.SUM, shape))(jnp.int32(5))
    np.testing.assert_array_equal(np.asarray(again), base)
    assert len(np.unique(base)) > 0.99 * base.size
    for args in ((SEED, 6, 2, _rounding.SUM), (SEED, 5, 3, _rounding.SUM),
                 (SEED, 5, 2, _rounding.DECAY), (SEED + 1, 5, 2, _rounding.SUM)):
        other = np.asarray(_bits(args[0], jnp.int32(args[1]), *args[2:], shape))
        assert np.mean(other == base) < 0.01, args


@pytest.mark.parametrize("write", [_rounding.SUM, _rounding.DECAY])
def test_step_keys_are_each_leafs_step_key(write):
    """The batched keys of every leaf are :func:`step_key`'s, leaf by leaf, at a traced step
    drawn at random; and they are distinct."""
    count = int(np.random.default_rng().integers(0, 2 ** 31 - 1))
    seed = int(np.random.default_rng().integers(0, 2 ** 31 - 1))
    keys = np.asarray(jax.jit(lambda c: _rounding.step_keys(seed, c, write, 7))(
        jnp.int32(count)))
    want = np.stack([np.asarray(_rounding.step_key(seed, jnp.int32(count), leaf, write))
                     for leaf in range(7)])
    np.testing.assert_array_equal(keys, want)
    assert len({tuple(k) for k in keys}) == 7


def test_the_steps_threefry_hashes_do_not_grow_with_its_leaves():
    """The keys of a 16-bit momentum's writes are folded for all leaves at once, so the step's
    program holds the same number of Threefry ``fold_in`` hashes for 2 leaves as for 12 (four
    per leaf and write made the GPU compile of an 8-layer model's step 2.4× slower)."""
    def calls(leaves):
        params = {f"w{i}": jnp.zeros((16, 8), jnp.float32) for i in range(leaves)}
        tx = dion3_jax.dion3(1e-3, 0.5, mu_dtype=jnp.bfloat16)
        state = tx.init(params)
        return str(jax.make_jaxpr(tx.update)(params, state, params)).count("random_fold_in")

    few, many = calls(2), calls(12)
    assert 0 < few == many, (few, many)


@pytest.mark.parametrize("spec", [P("a", None), P(None, "b"), P("b", "a"), P(("a", "b"), None),
                                  P(None, ("b", "a"))])
def test_bits_of_a_shard_are_the_leafs_bits(spec):
    """Inside ``shard_map``, each device's bits are the slice of the whole leaf's bits at its
    shard: a sharded momentum rounds as it would on one device."""
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Explicit,) * 2,
                         devices=jax.devices()[:8])
    shape = (16, 24)
    whole = _bits(SEED, jnp.int32(3), 1, _rounding.SUM, shape)
    local = tuple(n // int(np.prod([mesh.shape[a] for a in
                                    ((e,) if isinstance(e, str) else e or ())]))
                  for n, e in zip(shape, spec))
    sharded = jax.jit(jax.shard_map(
        lambda c: _bits(SEED, c, 1, _rounding.SUM, local, spec),
        mesh=mesh, in_specs=P(), out_specs=spec))(jnp.int32(3))
    np.testing.assert_array_equal(np.asarray(sharded), np.asarray(whole))


def _row_sum_error(grads: np.ndarray, dtype, stochastic: bool) -> float:
    def body(m, xs):
        g, t = xs
        bits = _bits(SEED, t, 0, _rounding.SUM, m.shape) if stochastic else None
        return pallas_kernels.scaled_sum(m, g, jnp.ones((), jnp.float32), bits), None

    steps = jnp.arange(grads.shape[0], dtype=jnp.int32)
    m = jax.jit(lambda g: jax.lax.scan(body, jnp.zeros(g.shape[1:], dtype), (g, steps))[0])(
        jnp.asarray(grads))
    ref = grads.astype(np.float64).sum(axis=0)
    return float(np.linalg.norm(np.asarray(m, np.float64) - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("dtype,steps", [(jnp.bfloat16, 4000), (jnp.float16, 10000)])
def test_never_selected_row_sums_like_float64(dtype, steps):
    """A row that is never selected sums its gradients (``G = d + N(0, 1)``, a per-entry mean
    ``d ~ N(0, 0.3²)``) through ``scaled_sum``, as ``benchmarks/momentum_dtype.py``'s second
    table does. Against the float64 sum, round-to-nearest stalls once the gradients fall below
    half the gap of the sum (relative error about 0.5 for bfloat16 after 4000 steps, 0.1 for
    float16 after 10000); stochastic rounding stays a zero-mean walk (0.06, 0.02)."""
    rng = np.random.default_rng(SEED)
    grads = (0.3 * rng.standard_normal(128) + rng.standard_normal((steps, 128))).astype(np.float32)
    nearest = _row_sum_error(grads, dtype, False)
    stochastic = _row_sum_error(grads, dtype, True)
    assert stochastic < 0.04 if dtype == jnp.float16 else stochastic < 0.15, stochastic
    assert stochastic < nearest / 3, (stochastic, nearest)


def _momentum_after_three_steps(mu_dtype):
    """The momentum of ``scale_by_dion3(0.25, 0.9)`` after three steps on this module's
    gradients (a fresh transform, traced and compiled anew, each call)."""
    rng = np.random.default_rng(SEED)
    grads = [{"w": jnp.asarray(rng.standard_normal((32, 64)), jnp.float32),
              "k": jnp.asarray(rng.standard_normal((2, 16, 64)), jnp.float32)} for _ in range(3)]
    tx = dion3_jax.scale_by_dion3(0.25, 0.9, mu_dtype=mu_dtype)
    state = tx.init(jax.tree.map(jnp.zeros_like, grads[0]))
    for g in grads:
        _, state = jax.jit(tx.update)(g, state)
    return state.momentum


def test_step_rounds_16bit_momentum_stochastically_and_reproducibly(monkeypatch):
    """Through ``scale_by_dion3``: a bfloat16 momentum is the same in two runs (bits from the
    step count and the leaf) and not what round-to-nearest gives."""
    first, second = (_momentum_after_three_steps(jnp.bfloat16) for _ in range(2))
    monkeypatch.setattr(_rounding, "stochastic", lambda dtype: False)
    nearest = _momentum_after_three_steps(jnp.bfloat16)
    for k in first:
        assert first[k].dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(first[k]), np.asarray(second[k]))
        assert not np.array_equal(np.asarray(first[k]), np.asarray(nearest[k])), k


@pytest.mark.slow  # two more step compiles; the fast loop keeps the 16-bit case above
def test_float32_momentum_is_untouched_by_the_rounding_switch(monkeypatch):
    """A float32 momentum takes no stochastic rounding: the same bits with the switch off."""
    f32 = _momentum_after_three_steps(jnp.float32)
    monkeypatch.setattr(_rounding, "stochastic", lambda dtype: False)
    f32_nearest = _momentum_after_three_steps(jnp.float32)
    for k in f32:
        assert f32[k].dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(f32[k]), np.asarray(f32_nearest[k]))


@pytest.mark.slow  # ~4 s a case; the fast loop keeps a shard's bits against the leaf's
@pytest.mark.parametrize("dtype,spec", [(jnp.bfloat16, P(None, "x")),
                                        (jnp.float16, P(None, "x")), (jnp.float16, P("x", None))])
def test_sharded_16bit_momentum_equals_one_device(dtype, spec):
    """A sharded 16-bit momentum after three steps is the one-device momentum, bit for bit in
    float64 (``momentum × momentum_scale``): the bits are per global element, the sums before
    them elementwise, the rows selected over the whole matrix, as on one device. A float16
    momentum's storage scale is the same power of two on every device (row-sharded: the same
    as on one device; column-sharded, from partial row norms: another power of two, which
    stochastic rounding commutes with)."""
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:8])
    rng = np.random.default_rng(SEED)
    grads = [{"w": jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)} for _ in range(3)]
    options = dion3_jax.MeshOptions(selection_scope="global")

    def run(put):
        tx = dion3_jax.scale_by_dion3(0.25, 0.9, mu_dtype=dtype, mesh_options=options)
        state = tx.init(put(jax.tree.map(jnp.zeros_like, grads[0])))
        for g in grads:
            _, state = jax.jit(tx.update)(put(g), state)
        assert state.momentum["w"].dtype == dtype
        return (np.asarray(state.momentum["w"], np.float64)
                * np.asarray(state.momentum_scale["w"], np.float64)), state.momentum_bound

    one, one_bound = run(lambda t: t)
    with jax.set_mesh(mesh):
        sharded, bound = run(lambda t: jax.device_put(t, NamedSharding(mesh, spec)))
    np.testing.assert_array_equal(sharded, one)
    if dtype == jnp.float16 and spec == P(None, "x"):
        np.testing.assert_array_equal(np.asarray(bound["w"]), np.asarray(one_bound["w"]))


def test_statistics_pass_with_bits_runs_in_xla():
    """``accumulate_rows`` with an array of random bits: ``"auto"`` runs the jnp form (a kernel
    takes the bits as a counter, ``tests/test_row_stats_stochastic.py``), whose ``S`` is
    ``scaled_sum``'s with the same bits and whose row sums are of that ``S``; a named kernel
    raises instead of rounding otherwise."""
    rng = np.random.default_rng(SEED)
    m = jnp.asarray(rng.standard_normal((2, 64, 64)), jnp.bfloat16)
    g = jnp.asarray(rng.standard_normal((2, 64, 64)), jnp.float32)
    d = jnp.asarray(rng.uniform(0.5, 1.0, (2, 64)), jnp.float32)
    bits = _bits(SEED, jnp.int32(1), 0, _rounding.SUM, m.shape)
    assert pallas_kernels.accumulate_rows_implementation((64, 64), 1, "auto", True) == "xla"
    s, l1, _ = pallas_kernels.accumulate_rows(m, g, d, row_axis=1, interpret=True, bits=bits)
    want = pallas_kernels.scaled_sum(m, g, d[:, :, None], bits)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(want))
    assert not np.array_equal(np.asarray(want),
                              np.asarray(pallas_kernels.scaled_sum(m, g, d[:, :, None])))
    np.testing.assert_allclose(np.asarray(l1), np.abs(np.asarray(want, np.float64)).sum(2),
                               rtol=1e-5)
    with pytest.raises(ValueError, match=r"'mosaic' takes the random bits as counter="):
        pallas_kernels.accumulate_rows(m, g, d, row_axis=1, implementation="mosaic",
                                       interpret=True, bits=bits)
