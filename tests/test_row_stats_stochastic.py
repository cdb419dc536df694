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
"""The statistics pass on a 16-bit momentum, rounded stochastically inside the kernels.

The kernels hash each element's counter words themselves (``pallas_kernels._counter``); through
interpret mode on the CPU (GPU interpret mode for the Mosaic kernel, Pallas' interpreter for the
Pallas-Triton one) their ``S`` is bit for bit the jnp reference's (bfloat16 and float16, both
row axes, several strips and chunks, counters that wrap modulo 2³², values that round up, down,
saturate or are not finite) and their row sums are those of their ``S``. A leaf's blocks'
counters (``dion3_jax._rounding.block_counters``) give the leaf's bits, on one device and in
``shard_map``; the step through the interpreted kernel gives XLA's momentum bit for bit. Which
implementation runs: ``"auto"`` takes the Mosaic kernel on Hopper; a bits array for a named
kernel, and a named kernel for a leaf without counters, raise. The kernels on a GPU are in
``tests/test_kernels_gpu.py``.
"""

import dataclasses
import functools

import jax
from jax.sharding import (AbstractDevice, AbstractMesh, AxisType, PartitionSpec as P,
                          use_abstract_mesh)
import jax.numpy as jnp
import numpy as np
import pytest

import dion3_jax
import pallas_kernels
from dion3_jax import _layout, _rounding
from pallas_kernels import accumulate_rows_implementation, accumulate_rows_reference
from pallas_kernels._counter import RowCounter, check_counter, counter_bits
from pallas_kernels._row_stats_mosaic import MosaicRowStatsConfig, accumulate_rows_mosaic
from pallas_kernels._row_stats_triton import RowStatsConfig, accumulate_rows_triton
from seeds import module_seed

#: Fresh random inputs per run, printed with every test (tests/seeds.py).
SEED = module_seed()

H200 = AbstractDevice("NVIDIA H200", 132, "gpu")
#: Small blocks: three strips, three chunks of one step (axis 2), or two of two (axis 1).
_SMALL = {2: MosaicRowStatsConfig(strip=16, step=64, chunk=64, stages=2),
          1: MosaicRowStatsConfig(strip=64, step=16, chunk=32, stages=2)}
_SHAPES = {2: (2, 192, 48), 1: (1, 128, 64)}
#: The Pallas-Triton kernel's: three strips and three chunks of two steps (both axes).
_SMALL_TRITON = {2: RowStatsConfig(strip=16, step=32, chunk=64),
                 1: RowStatsConfig(strip=8, step=16, chunk=32)}
_SHAPES_TRITON = {2: (2, 192, 48), 1: (1, 24, 96)}
#: Per dtype: the saturation bound of ``S`` (float16's largest finite value; bfloat16's 2⁷⁹).
_BOUND = {jnp.bfloat16: 2.0 ** 79, jnp.float16: 65504.0}
#: The counter hash's first multiplier (``pallas_kernels._counter_hash``) as lowered text.
_M1 = "dense<2246822507>"
#: The jnp reference, jitted: one compile per call signature rather than one per operation.
_reference = jax.jit(accumulate_rows_reference, static_argnames="row_axis")


def _words(rng, shape) -> jax.Array:
    return jnp.asarray(rng.integers(0, 2 ** 32, shape, dtype=np.uint64).astype(np.uint32))


def _inputs(rng, shape, row_axis, dtype):
    """A 16-bit momentum and a float32 gradient 1/64 its size (most sums fall between two
    16-bit values), with sums that saturate and non-finite entries; per-row decays."""
    m = rng.standard_normal(shape).astype(np.float32)
    g = rng.standard_normal(shape).astype(np.float32) / 64
    m[0, 1, :4], g[0, 1, :4] = _BOUND[dtype] * 0.9, _BOUND[dtype] * 0.5       # saturate
    m[0, 2, :4], g[0, 2, :4] = -_BOUND[dtype] * 0.9, -_BOUND[dtype] * 0.5
    m[0, 3, 5], g[0, 4, 6], m[0, 5, 7] = np.inf, -np.inf, np.nan
    d = rng.choice([0.8145, 0.95, 1.0], (shape[0], shape[row_axis])).astype(np.float32)
    return jnp.asarray(m).astype(dtype), jnp.asarray(g), jnp.asarray(d)


def _counter(rng, shape, row_axis, steps):
    return RowCounter(_words(rng, (2,)), _words(rng, (shape[0], 2, shape[row_axis])), steps)


@functools.cache
def _jitted_kernel(impl, row_axis):
    """The interpreted kernel ``impl`` at ``row_axis``, jitted once: calls of one signature
    within a test (and across tests) share one compile."""
    kernel, config = ((accumulate_rows_mosaic, _SMALL) if impl == "mosaic"
                      else (accumulate_rows_triton, _SMALL_TRITON))
    return jax.jit(functools.partial(kernel, row_axis=row_axis, config=config[row_axis],
                                     interpret=True))


def _kernel(m, g, d, row_axis, counter, impl="mosaic", out_scale=None):
    s, l1, sq = _jitted_kernel(impl, row_axis)(m, g, d, counter=counter, out_scale=out_scale)
    return s, jnp.sum(l1, axis=1), jnp.sum(sq, axis=1)


def _bits16(x) -> np.ndarray:
    return np.asarray(x).view(np.uint16)


@pytest.mark.parametrize("row_axis,steps", [(1, (0, 1)), (1, (0x9E3779B9, 1)), (2, (1, 0))])
def test_a_counter_with_a_common_start_rounds_as_the_reference(row_axis, steps):
    """A counter whose stepping words start alike on every row of a matrix (``common_start``:
    the Mosaic kernel hashes them once per index along the summed axis, on a vector) rounds
    ``S`` bit for bit as the reference and as the kernel without the promise; each matrix has
    its own start. The kernel does take the shortcut: with the promise broken (rows that start
    apart) its bits are not the reference's (it reads each strip's first row's start)."""
    rng = np.random.default_rng(SEED)
    shape = _SHAPES[row_axis]
    m, g, d = _inputs(rng, shape, row_axis, jnp.float16)
    apart = np.array(_words(rng, (shape[0], 2, shape[row_axis])))
    aligned = apart.copy()
    for w in (0, 1):
        if steps[w]:
            aligned[:, w, :] = apart[:, w, :1]
    plain = RowCounter(_words(rng, (2,)), jnp.asarray(aligned), steps)
    common = dataclasses.replace(plain, common_start=True)
    want = _bits16(_reference(m, g, d, row_axis=row_axis, counter=plain)[0])
    np.testing.assert_array_equal(_bits16(_kernel(m, g, d, row_axis, common)[0]), want)
    np.testing.assert_array_equal(_bits16(_kernel(m, g, d, row_axis, plain)[0]), want)
    broken = _bits16(_kernel(m, g, d, row_axis,
                             dataclasses.replace(common, rows=jnp.asarray(apart)))[0])
    apart_s = _reference(m, g, d, row_axis=row_axis,
                         counter=dataclasses.replace(plain, rows=jnp.asarray(apart)))[0]
    assert np.mean(broken != _bits16(apart_s)) > 0.1


@pytest.mark.parametrize("row_axis", [1, 2])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("impl", ["mosaic",
                                  pytest.param("pallas_triton", marks=pytest.mark.slow)])
def test_interpreted_kernel_rounds_as_the_reference(impl, row_axis, dtype):
    """``S`` bit for bit the reference's, which is not round-to-nearest's and not that of
    another key (so the kernel hashes the key and the words); saturated sums stay at the
    bound, ``inf``/NaN stay; the row sums are those of the kernel's ``S`` (float64, within float32 summation error)."""
    rng = np.random.default_rng(SEED)
    shape = (_SHAPES if impl == "mosaic" else _SHAPES_TRITON)[row_axis]
    m, g, d = _inputs(rng, shape, row_axis, dtype)
    counter = _counter(rng, shape, row_axis, (0x9E3779B9, 1) if row_axis == 1 else (1, 0))
    got = _kernel(m, g, d, row_axis, counter, impl)
    want = _reference(m, g, d, row_axis=row_axis, counter=counter)
    assert got[0].dtype == dtype
    np.testing.assert_array_equal(_bits16(got[0]), _bits16(want[0]))
    nearest = _reference(m, g, d, row_axis=row_axis)[0]
    assert np.mean(_bits16(got[0]) != _bits16(nearest)) > 0.1
    other = RowCounter(counter.key ^ np.uint32(1), counter.rows, counter.steps)
    other_s = _reference(m, g, d, row_axis=row_axis, counter=other)[0]
    assert np.mean(_bits16(other_s) != _bits16(got[0])) > 0.1
    s = np.asarray(got[0], np.float64)
    np.testing.assert_array_equal(np.abs(s[0, 1:3, :4]), _BOUND[dtype])
    assert s[0, 3, 5] == np.inf and s[0, 4, 6] == -np.inf and np.isnan(s[0, 5, 7])
    summed = 3 - row_axis
    finite = np.where(np.isfinite(s), s, 0.0)
    for got_sum, want_sum, x in ((got[1], want[1], np.abs(finite)),
                                 (got[2], want[2], (finite * 2.0 ** -32) ** 2)):
        ok = np.all(np.isfinite(s), axis=summed)
        np.testing.assert_allclose(np.asarray(got_sum)[ok], x.sum(summed)[ok],
                                   rtol=shape[summed] * 2.0 ** -23)
        np.testing.assert_allclose(np.asarray(got_sum)[ok], np.asarray(want_sum)[ok],
                                   rtol=shape[summed] * 2.0 ** -23)


@pytest.mark.parametrize("impl", ["mosaic",
                                  pytest.param("pallas_triton", marks=pytest.mark.slow)])
def test_a_counter_over_a_key_table_rounds_with_its_row(impl):
    """A counter over a table of keys (a step's keys of every leaf) and a row index: the
    kernel's ``S`` is bit for bit that of the counter of the row's lone key, and not that of
    the next row's key; the reference agrees."""
    rng = np.random.default_rng()
    row_axis, steps = 1, (0x9E3779B9, 1)
    shape = (_SHAPES if impl == "mosaic" else _SHAPES_TRITON)[row_axis]
    m, g, d = _inputs(rng, shape, row_axis, jnp.float16)
    keys, rows = _words(rng, (5, 2)), _words(rng, (shape[0], 2, shape[row_axis]))
    i = int(rng.integers(1, 4))                 # not row 0, which a kernel might read
    table = RowCounter(keys, rows, steps, jnp.asarray([i], jnp.int32))
    got = _bits16(_kernel(m, g, d, row_axis, table, impl)[0])
    lone = _bits16(_kernel(m, g, d, row_axis, RowCounter(keys[i], rows, steps), impl)[0])
    np.testing.assert_array_equal(got, lone)
    reference = _reference(m, g, d, row_axis=row_axis, counter=table)[0]
    np.testing.assert_array_equal(got, _bits16(reference))
    other = _reference(m, g, d, row_axis=row_axis,
                       counter=RowCounter(keys[i + 1], rows, steps))[0]
    assert np.mean(got != _bits16(other)) > 0.1


@pytest.mark.parametrize("key,index", [((5, 2), None), ((5, 2), (2,)), ((5, 3), (1,)),
                                       ((2,), (1,))])
def test_a_counter_s_key_must_be_a_key_or_a_table_with_a_row(key, index):
    """A table of keys without its ``(1,)`` row index, a longer index, keys of three words or a
    lone key with an index are refused, naming the shapes."""
    rows = jnp.zeros((1, 2, 8), jnp.uint32)
    counter = RowCounter(jnp.zeros(key, jnp.uint32), rows, (0, 1),
                         None if index is None else jnp.zeros(index, jnp.int32))
    with pytest.raises(ValueError, match=r"a \(keys, 2\) table with a \(1,\) integer index"):
        check_counter(counter, 1, 8)
    check_counter(RowCounter(jnp.zeros((5, 2), jnp.uint32), rows, (0, 1),
                             jnp.zeros((1,), jnp.int32)), 1, 8)


@pytest.mark.parametrize("row_axis", [1, 2])
@pytest.mark.parametrize("dtype,stochastic", [(jnp.float16, True), (jnp.float32, False)])
@pytest.mark.parametrize("impl", ["mosaic",
                                  pytest.param("pallas_triton", marks=pytest.mark.slow)])
def test_interpreted_kernel_scales_the_gradients(impl, dtype, stochastic, row_axis):
    """With ``out_scale = 2^k`` (``k`` drawn in ±[1, 20]) the kernel's ``S`` is the reference's
    bit for bit, and the reference's is that of the row factors and the gradients multiplied by
    ``2^k`` first (exact in float64): ``2^k·(d ⊙ M + G)``; a scale of 1 leaves ``S`` as without
    one."""
    rng = np.random.default_rng()
    shape = (_SHAPES if impl == "mosaic" else _SHAPES_TRITON)[row_axis]
    m = jnp.asarray(rng.standard_normal(shape), dtype)
    g = jnp.asarray(rng.standard_normal(shape) * 2.0 ** rng.integers(-30, 30), jnp.float32)
    d = jnp.asarray(rng.uniform(0.5, 1.0, (shape[0], shape[row_axis])), jnp.float32)
    k = int(rng.choice([-1, 1]) * rng.integers(1, 21))
    scale = jnp.float32(2.0 ** k)
    counter = _counter(rng, shape, row_axis, (0x9E3779B9, 1) if row_axis == 1 else (1, 0)
                       ) if stochastic else None
    got = _kernel(m, g, d, row_axis, counter, impl, out_scale=scale)
    want = _reference(m, g, d, row_axis=row_axis, counter=counter, out_scale=scale)
    g_k, d_k = (jnp.asarray(np.asarray(x, np.float64) * 2.0 ** k, jnp.float32) for x in (g, d))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_array_equal(
        np.asarray(want[0]),
        np.asarray(_reference(m, g_k, d_k, row_axis=row_axis, counter=counter)[0]))
    for got_sum, want_sum in zip(got[1:], want[1:]):
        np.testing.assert_allclose(np.asarray(got_sum), np.asarray(want_sum),
                                   rtol=shape[3 - row_axis] * 2.0 ** -23)
    one = _kernel(m, g, d, row_axis, counter, impl, out_scale=jnp.float32(1))[0]
    np.testing.assert_array_equal(np.asarray(one),
                                  np.asarray(_kernel(m, g, d, row_axis, counter, impl)[0]))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_counter_rows_words_place_each_element(dtype):
    """Elements whose counter words are equal round equally: a counter whose rows' words are
    shifted by one step along the row gives the reference's ``S`` shifted by one element (so
    the kernel reads each element's own words, not a block's or a chunk's)."""
    rng = np.random.default_rng(SEED + 1)
    row_axis, shape = 1, _SHAPES[1]
    m = jnp.ones(shape, dtype)
    g = jnp.full(shape, float(jnp.finfo(dtype).eps) / 2, jnp.float32)    # halfway: S rounds
    # up or down with probability 1/2
    d = jnp.ones((shape[0], shape[1]), jnp.float32)
    counter = _counter(rng, shape, row_axis, (0, 1))
    shifted = RowCounter(counter.key, counter.rows.at[:, 1].add(np.uint32(1)), (0, 1))
    a = _bits16(_kernel(m, g, d, row_axis, counter)[0])
    b = _bits16(_kernel(m, g, d, row_axis, shifted)[0])
    np.testing.assert_array_equal(b[:, :, :-1], a[:, :, 1:])
    assert 0.2 < np.mean(a != a[0, 0, 0]) < 0.8        # both neighbours occur


def test_interpreted_kernel_has_no_data_race():
    """GPU interpret mode's race detector finds none with the rows' words' copy and barrier."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    rng = np.random.default_rng(SEED + 4)
    shape = _SHAPES[2]
    m, g, d = _inputs(rng, shape, 2, jnp.bfloat16)
    jax.block_until_ready(accumulate_rows_mosaic(
        m, g, d, row_axis=2, config=_SMALL[2], counter=_counter(rng, shape, 2, (1, 0)),
        interpret=InterpretGPUParams(detect_races=True)))
    assert interpret_pallas_call.get_races().races_found is False


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_lowers_for_h200_without_an_array_of_bits(dtype):
    """At a benchmark shape, both row axes: one Mosaic GPU call that writes ``S`` in place of
    the momentum, no element-sized array of bits anywhere (the only uint32 operands are the
    key and the rows' words) and no hashing outside the kernel (no uint32 product of a block's
    size, no MurmurHash3 multiplier); XLA's form has both: four products per element (the
    stepping word's line hash and the final mix)."""
    mesh = AbstractMesh((1,), ("x",), axis_types=(AxisType.Explicit,), abstract_device=H200)
    sds = jax.ShapeDtypeStruct
    for row_axis, shape, steps in ((2, (2, 4096, 11008), (1, 0)), (1, (2, 11008, 4096), (0, 1))):
        n = shape[row_axis]
        texts = []
        for impl in ("mosaic", "xla"):
            fn = jax.jit(functools.partial(
                lambda m, g, d, key, rows, impl, row_axis, steps: pallas_kernels.accumulate_rows(
                    m, g, d, row_axis=row_axis, implementation=impl,
                    counter=RowCounter(key, rows, steps)),
                impl=impl, row_axis=row_axis, steps=steps))
            with use_abstract_mesh(mesh):
                texts.append(fn.trace(sds(shape, dtype), sds(shape, jnp.float32),
                                      sds((2, n), jnp.float32), sds((2,), jnp.uint32),
                                      sds((2, 2, n), jnp.uint32)).lower(
                    lowering_platforms=("cuda",)).as_text())
        bits = "x".join(map(str, shape)) + "xui32"
        assert texts[0].count("custom_call @mosaic_gpu") == 1
        assert "output_operand_alias<output_tuple_indices = [2], operand_index = 1" in texts[0]
        # The counter hash's multiplier: element-sized uint32 products in XLA's form only.
        products = [sum("stablehlo.multiply" in line and f"tensor<{bits}>" in line
                        for line in t.splitlines()) for t in texts]
        assert bits not in texts[0] and _M1 not in texts[0] and products[0] == 0
        assert bits in texts[1] and _M1 in texts[1] and products[1] == 4


_LAYOUTS = [((64, 48), None, None, None),
            ((3, 32, 48), None, None, None),
            ((48, 64), _layout.DimensionNumbers(reduction_axis=1, output_axis=0), None, None),
            ((32, 4, 16), _layout.DimensionNumbers(reduction_axis=0, output_axis=(1, 2)), 4,
             None),
            ((2, 64, 16), _layout.DimensionNumbers(reduction_axis=2, output_axis=1), 4, None),
            ((32, 48), None, None, (16, 32)),
            ((3, 3, 8, 16), _layout.DimensionNumbers(reduction_axis=(0, 1, 2), output_axis=3),
             None, None)]


@pytest.mark.parametrize("shape,dn,heads,splits", _LAYOUTS)
def test_block_counters_give_the_leafs_bits(shape, dn, heads, splits):
    """Per block of a leaf (stacked, transposed, heads, split, merged reduction axes), the
    counter's bits are the leaf's bits in that block."""
    layout = _layout.make_layout(shape, dn, heads, splits)

    @jax.jit   # one compile rather than one per operation
    def bits(seed):
        key = _rounding.step_key(seed, jnp.int32(3), 2, _rounding.SUM)
        whole = layout.to_blocks(_rounding.momentum_bits(key, shape))
        counters = _rounding.block_counters(key, layout)
        return whole, [counter_bits(counter, want.shape, block.row_axis)
                       for want, counter, block in zip(whole, counters, layout.blocks)]

    whole, got = bits(SEED)
    assert len(got) == len(whole) == len(layout.blocks)
    for want, block_bits in zip(whole, got):
        np.testing.assert_array_equal(np.asarray(block_bits), np.asarray(want))


def test_block_counters_promise_a_common_start_only_where_rows_start_alike():
    """``common_start`` (the kernel then hashes the stepping words per index along the summed
    axis) holds on every layout that claims it: each matrix's rows start their stepping words
    at one value. 2-D leaves in either orientation and stacked matrices claim it; a layout
    whose rows span a heads axis that the stepping word counts does not."""
    key = _rounding.step_key(SEED, jnp.int32(1), 0, _rounding.SUM)
    claims = []
    for shape, dn, heads, splits in _LAYOUTS:
        for counter in _rounding.block_counters(key, _layout.make_layout(shape, dn, heads,
                                                                         splits)):
            rows = np.asarray(counter.rows)
            alike = all(np.all(rows[:, w] == rows[:, w, :1]) for w in (0, 1)
                        if counter.steps[w] % 2 ** 32)
            assert alike or not counter.common_start, (shape, dn, heads, splits)
            claims.append(counter.common_start)
    assert claims[:3] == [True] * 3 and not all(claims)


def test_block_counters_are_none_where_the_words_do_not_step_evenly():
    """Reduction axes ``(1, 3)`` of a 4-D leaf: along a row the ``hi`` word jumps by 6 and the
    ``lo`` word by 1 in turn, so the block has no counter."""
    dn = _layout.DimensionNumbers(reduction_axis=(1, 3), output_axis=(0, 2))
    layout = _layout.make_layout((4, 8, 6, 5), dn)
    key = _rounding.step_key(SEED, jnp.int32(0), 0, _rounding.SUM)
    assert _rounding.block_counters(key, layout) == [None]


@pytest.mark.parametrize("spec", [P("a", None, None), P(None, "b", None), P(None, None, "b"),
                                  P(None, ("a", "b"), None), P("b", None, "a")])
def test_block_counters_of_a_shard_give_the_leafs_bits(spec):
    """Inside ``shard_map``, each device's block counters give the slice of the whole leaf's
    bits at its shard (the shard's offsets enter the rows' words)."""
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Explicit,) * 2,
                         devices=jax.devices()[:8])
    shape = (8, 16, 32)
    whole = _rounding.momentum_bits(_rounding.step_key(SEED, jnp.int32(4), 1, _rounding.SUM),
                                    shape)
    local = tuple(n // int(np.prod([mesh.shape[a] for a in
                                    ((e,) if isinstance(e, str) else e or ())]))
                  for n, e in zip(shape, tuple(spec)))
    layout = _layout.make_layout(local)

    def bits(c):
        key = _rounding.step_key(SEED, c, 1, _rounding.SUM)
        [counter] = _rounding.block_counters(key, layout, spec)
        [block] = layout.blocks
        return layout.from_blocks([counter_bits(counter, block.shape, block.row_axis)], local)

    sharded = jax.jit(jax.shard_map(bits, mesh=mesh, in_specs=P(), out_specs=spec))(
        jnp.int32(4))
    np.testing.assert_array_equal(np.asarray(sharded), np.asarray(whole))


def test_auto_takes_the_mosaic_kernel_for_a_16_bit_momentum_on_hopper():
    """On an H200 ``"auto"`` and ``"mosaic"`` take the Mosaic kernel whatever the momentum's
    dtype (a stochastically rounded one too: the choice no longer asks), ``"pallas_triton"``
    its kernel; on the CPU ``"auto"`` is XLA."""
    mesh = AbstractMesh((1,), ("x",), axis_types=(AxisType.Explicit,), abstract_device=H200)
    with use_abstract_mesh(mesh):
        for row_axis in (1, 2):
            assert accumulate_rows_implementation((4096, 4096), row_axis, "auto") == "mosaic"
            assert accumulate_rows_implementation((4096, 4096), row_axis, "mosaic") == "mosaic"
        assert accumulate_rows_implementation((40, 64), 2, "auto") == "xla"
        assert accumulate_rows_implementation((4096, 4096), 2, "pallas_triton") == "pallas_triton"
    assert accumulate_rows_implementation((4096, 4096), 2, "auto") == "xla"


def test_accumulate_rows_routes_counters_and_bits():
    """``counter=`` through ``"auto"`` on the CPU and through the interpreted Pallas-Triton
    kernel is the reference's; a bits array for a named kernel, or both at once, raise."""
    rng = np.random.default_rng(SEED + 2)
    shape = (1, 64, 32)
    m, g, d = _inputs(rng, shape, 1, jnp.bfloat16)
    counter = _counter(rng, shape, 1, (0, 1))
    s, _, _ = pallas_kernels.accumulate_rows(m, g, d, row_axis=1, counter=counter)
    want = _reference(m, g, d, row_axis=1, counter=counter)[0]
    np.testing.assert_array_equal(_bits16(s), _bits16(want))
    bits = counter_bits(counter, shape, 1)
    with pytest.raises(ValueError, match="not both"):
        pallas_kernels.accumulate_rows(m, g, d, row_axis=1, bits=bits, counter=counter)
    s, _, _ = pallas_kernels.accumulate_rows(m, g, d, row_axis=1, interpret=True,
                                             implementation="pallas_triton", counter=counter)
    np.testing.assert_array_equal(_bits16(s), _bits16(want))
    with pytest.raises(ValueError, match=r"'mosaic' takes the random bits as counter="):
        pallas_kernels.accumulate_rows(m, g, d, row_axis=1, implementation="mosaic",
                                       interpret=True, bits=bits)


def _xla_polar():
    # A float32 iteration: a float16 one turns the row sums' last bit into float16 roundings
    # of the polar's products, a few of its ulps in the update.
    return dion3_jax.make_orthogonalizer(backend="xla", compute_dtype=jnp.float32)


@pytest.mark.slow  # ~5 s a case; the fast loop keeps the kernel against the reference
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_the_step_through_the_interpreted_kernel_gives_xlas_momentum(monkeypatch, dtype):
    """Two steps of a 16-bit momentum (a matrix and a stack of two) at f = 1, the statistics
    pass through the interpreted Mosaic kernel with the blocks' counters (a float16 one with
    its storage scale): the momentum and its row factors are the XLA step's bit for bit, and
    the updates agree (the row sums add up in another order)."""
    rng = np.random.default_rng(SEED + 3)
    grads = [{"w": jnp.asarray(rng.standard_normal((64, 32)), jnp.float32),
              "k": jnp.asarray(rng.standard_normal((2, 64, 32)), jnp.float32)}
             for _ in range(2)]

    def run():
        tx = dion3_jax.scale_by_dion3(1.0, 0.9, mu_dtype=dtype, orthogonalizer=_xla_polar())
        state = tx.init(jax.tree.map(jnp.zeros_like, grads[0]))
        for g in grads:
            updates, state = jax.jit(tx.update)(g, state)
        return (state.momentum, state.momentum_scale), updates

    want_m, want_u = run()
    calls = []
    real = pallas_kernels.accumulate_rows

    def interpreted(*args, **kwargs):
        calls.append(kwargs["counter"])
        return real(*args, **{**kwargs, "implementation": "mosaic", "interpret": True})

    monkeypatch.setattr(pallas_kernels, "accumulate_rows_implementation",
                        lambda *args, **kwargs: "mosaic")
    monkeypatch.setattr(pallas_kernels, "accumulate_rows", interpreted)
    got_m, got_u = run()
    assert calls and all(c is not None for c in calls)      # both leaves, each trace
    for k in grads[0]:
        assert got_m[0][k].dtype == dtype
        np.testing.assert_array_equal(_bits16(got_m[0][k]), _bits16(want_m[0][k]))
        np.testing.assert_array_equal(np.asarray(got_m[1][k]), np.asarray(want_m[1][k]))
        u, want = np.asarray(got_u[k]), np.asarray(want_u[k])
        # Up to 7e-6 of the largest entry over eight seeds (a float32 polar); 0 for most.
        np.testing.assert_allclose(u, want, rtol=0, atol=1e-4 * np.abs(want).max())


def _lower_for_h200(params, mu_dtype, **kwargs):
    mesh = AbstractMesh((1,), ("x",), axis_types=(AxisType.Explicit,), abstract_device=H200)
    with use_abstract_mesh(mesh):
        tx = dion3_jax.scale_by_dion3(1.0, 0.9, mu_dtype=mu_dtype, orthogonalizer=_xla_polar(),
                                      **kwargs)
        state = jax.eval_shape(tx.init, params)
        return jax.jit(tx.update).trace(params, state).lower(
            lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("mu_dtype", [jnp.bfloat16, jnp.float16])
def test_the_step_lowers_for_h200_with_the_kernel_for_16_bit_momenta(mu_dtype):
    """By default a bfloat16 or float16 momentum's statistics pass is the Mosaic kernel in the
    step lowered for an H200, as a float32 one's is (two groups: two statistics and two
    payload kernels at f = 1)."""
    params = {"up": jax.ShapeDtypeStruct((128, 320), jnp.float32),
              "down": jax.ShapeDtypeStruct((320, 128), jnp.float32)}
    assert _lower_for_h200(params, mu_dtype).count("custom_call @mosaic_gpu") == 4


def test_the_kernels_row_words_are_made_once_per_layout(monkeypatch):
    """The statistics kernels' counters share their row words among leaves of one layout: the
    step for an H200 with six 128×320 leaves and one 320×128 leaf (bfloat16 momentum) makes
    them twice, not once per leaf (each making traced about 20 operations per leaf)."""
    made = []
    real = _rounding.block_words
    monkeypatch.setattr(_rounding, "block_words",
                        lambda *args: made.append(args[0].shape) or real(*args))
    params = {f"w{i}": jax.ShapeDtypeStruct((128, 320), jnp.float32) for i in range(6)}
    params["down"] = jax.ShapeDtypeStruct((320, 128), jnp.float32)
    assert _lower_for_h200(params, jnp.bfloat16).count("custom_call @mosaic_gpu") == 4
    assert sorted(made) == [(128, 320), (320, 128)], made


def test_a_named_kernel_that_cannot_round_raises_naming_the_leaf():
    """``"mosaic"`` (or ``"pallas_triton"``) for a leaf whose bits do not step evenly along its
    blocks' rows raises a ``ValueError`` that names the leaf; ``"auto"`` runs that leaf's pass
    in XLA. ``"pallas_triton"`` lowers its kernel for a bfloat16 momentum."""
    import warnings

    params = {"up": jax.ShapeDtypeStruct((128, 320), jnp.float32)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        text = _lower_for_h200(params, jnp.bfloat16, pass_implementation="pallas_triton")
    assert "triton" in text
    uneven = {"conv": jax.ShapeDtypeStruct((64, 4, 2, 16), jnp.float32)}
    dn = _layout.DimensionNumbers(reduction_axis=(1, 3), output_axis=(0, 2))
    with pytest.raises(ValueError, match=r"\['conv'\] \(bfloat16 momentum\): .*'mosaic' needs "
                                         r"random bits that step evenly"):
        _lower_for_h200(uneven, jnp.bfloat16, pass_implementation="mosaic",
                        dimension_numbers=dn)
    assert "custom_call @mosaic_gpu" in _lower_for_h200(uneven, jnp.float32,
                                                        dimension_numbers=dn)
    text = _lower_for_h200(uneven, jnp.bfloat16, dimension_numbers=dn)
    assert text.count("custom_call @mosaic_gpu") == 1       # the payload pass only
