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
"""``pallas_kernels.accumulate_rows``: the statistics pass, ``S = d ⊙ M + G`` and its row sums.

The jnp reference against float64 on fresh inputs; the Pallas kernel (through Pallas' interpreter
on the CPU) against the reference: ``S`` bitwise, the sums within float32 summation error; its
Triton lowering for an H200 at the benchmark's shapes; the block choice and bad input; the Dion3
step with the kernel against the step with XLA. The kernel on a GPU is in
``tests/test_kernels_gpu.py``.
"""

import functools
import re

import jax
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dion3_jax
import pallas_kernels
from dion3_jax import _step
from pallas_kernels import _row_stats_triton, accumulate_rows, accumulate_rows_reference
from seeds import module_seed

#: Fresh random inputs per run, printed with every test (tests/seeds.py).
SEED = module_seed()


def _inputs(seed, shape, row_axis, m_dtype=jnp.float32, g_dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    m = jnp.asarray(rng.standard_normal(shape, np.float32)).astype(m_dtype)
    g = jnp.asarray(rng.standard_normal(shape, np.float32)).astype(g_dtype)
    d = jnp.asarray(rng.choice([0.8145, 1.0], (shape[0], shape[row_axis])).astype(np.float32))
    return m, g, d


def _float64_sums(s, row_axis):
    x = np.asarray(s, np.float64)
    return np.abs(x).sum(3 - row_axis), ((x * 2.0 ** -32) ** 2).sum(3 - row_axis)


@pytest.mark.parametrize("row_axis", [1, 2])
@pytest.mark.parametrize("m_dtype,g_dtype", [(jnp.float32, jnp.float32),
                                             (jnp.float32, jnp.bfloat16),
                                             (jnp.bfloat16, jnp.float32)])
def test_reference_matches_float64(row_axis, m_dtype, g_dtype):
    """``S`` within one rounding to M's dtype (and one float32 rounding) of ``d·M + G`` in
    float64; the ℓ1 norms and sums of squares of that ``S`` within float32 summation error."""
    shape = (2, 24, 40)
    m, g, d = _inputs(SEED, shape, row_axis, m_dtype, g_dtype)
    s, l1, sq = jax.jit(functools.partial(accumulate_rows_reference, row_axis=row_axis))(m, g, d)
    assert s.dtype == m_dtype and l1.dtype == sq.dtype == jnp.float32
    assert l1.shape == sq.shape == (2, shape[row_axis])
    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    dd = np.expand_dims(f64(d), 3 - row_axis)
    want = dd * f64(m) + f64(g)
    bound = (abs(want) * float(jnp.finfo(m_dtype).eps)
             + 2 * 2.0 ** -24 * (abs(dd * f64(m)) + abs(f64(g))))
    assert np.all(abs(f64(s) - want) <= bound)
    l1_64, sq_64 = _float64_sums(s, row_axis)
    count = shape[3 - row_axis]
    np.testing.assert_allclose(f64(l1), l1_64, rtol=count * 2.0 ** -24)
    np.testing.assert_allclose(f64(sq), sq_64, rtol=count * 2.0 ** -23)


def _assert_within_one_rounding(s, m, g, d, row_axis, want):
    """``s`` and ``want`` (float32 ``d·M + G``) differ by at most one rounding of the product
    (the magnitude before cancellation)."""
    dm = np.expand_dims(np.asarray(d, np.float64), 3 - row_axis) * np.asarray(m, np.float64)
    bound = 2.0 ** -23 * (abs(dm) + abs(np.asarray(g, np.float64)))
    assert np.all(abs(np.asarray(s, np.float64) - np.asarray(want, np.float64)) <= bound)


@pytest.mark.parametrize("row_axis,shape", [(2, (2, 512, 96)), (1, (2, 24, 4096)),
                                            (2, (3, 24, 48)), (1, (1, 40, 48))])
def test_kernel_interpreted_matches_reference(row_axis, shape):
    """The interpreted kernel: ``S`` within one float32 rounding of the reference's (the same
    maths; XLA may contract ``d·M + G`` into a fused multiply-add in one program and not in the
    other), the row sums within float32 summation error (the kernel adds block by block, chunks
    after). Shapes with one loop iteration and with several, one chunk and several, strips
    narrower than the configured ones."""
    m, g, d = _inputs(SEED, shape, row_axis, g_dtype=jnp.bfloat16)
    want = accumulate_rows_reference(m, g, d, row_axis=row_axis)
    got = jax.jit(functools.partial(accumulate_rows, row_axis=row_axis,
                                    implementation="pallas_triton", interpret=True))(m, g, d)
    _assert_within_one_rounding(got[0], m, g, d, row_axis, want[0])
    count = shape[3 - row_axis]
    for a, b in zip(got[1:], want[1:]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=count * 2.0 ** -23)


@pytest.mark.parametrize("implementation,row_axis,shape", [
    ("xla", 1, (2, 24, 4096)), ("pallas_triton", 2, (2, 512, 96)),
    ("pallas_triton", 1, (2, 24, 4096)), ("mosaic", 1, (1, 64, 1024))])
def test_partial_sums_add_up_to_the_row_sums(implementation, row_axis, shape):
    """``partial_sums=True``: the row sums as ``(batch, chunks, n)`` partials (one chunk for
    XLA, several for the kernels at these shapes), whose sum over axis 1 is exactly what the
    call returns without it; ``S`` is the same array."""
    m, g, d = _inputs(SEED, shape, row_axis)
    call = functools.partial(accumulate_rows, row_axis=row_axis, implementation=implementation,
                             interpret=implementation != "xla")
    s, l1, sq = jax.jit(call)(m, g, d)
    ps, pl1, psq = jax.jit(functools.partial(call, partial_sums=True))(m, g, d)
    n = shape[row_axis]
    chunks = 1 if implementation == "xla" else pl1.shape[1]
    assert pl1.shape == psq.shape == (shape[0], chunks, n)
    assert implementation == "xla" or chunks > 1, pl1.shape
    np.testing.assert_array_equal(np.asarray(ps), np.asarray(s))
    np.testing.assert_array_equal(np.asarray(jnp.sum(pl1, axis=1)), np.asarray(l1))
    np.testing.assert_array_equal(np.asarray(jnp.sum(psq, axis=1)), np.asarray(sq))


@pytest.mark.parametrize("row_axis", [1, 2])
def test_reference_sums_are_the_steps_row_sums(row_axis):
    """The step takes a block's row sums from this pass or, for the blocks it does not send
    here, from ``dion3_jax._selection`` (scores, payload norms): both must be the same numbers,
    scaled alike (the package cannot import ``dion3_jax``, so the formula is written twice)."""
    from dion3_jax import _selection

    m, g, d = _inputs(SEED, (2, 24, 40), row_axis)
    s, l1, sq = accumulate_rows_reference(m, g, d, row_axis=row_axis)
    np.testing.assert_array_equal(l1, _selection.row_l1_norms(s, row_axis))
    np.testing.assert_array_equal(sq, _selection.row_sq_sums(s, row_axis))


def test_blocks():
    assert _row_stats_triton.blocks((4096, 11008), 2) == (64, 32, 128)
    assert _row_stats_triton.blocks((11008, 4096), 2) == (64, 32, 128)     # 11008 = 86 · 128
    assert _row_stats_triton.blocks((11008, 4096), 1) == (8, 512, 2048)
    assert _row_stats_triton.blocks((24, 48), 2) == (16, 8, 8)
    assert _row_stats_triton.blocks((40, 48), 1) == (8, 16, 16)
    assert _row_stats_triton.blocks((64, 20), 2) is None      # 20 columns: no power-of-two ≥ 16
    assert _row_stats_triton.blocks((20, 8), 1) is None
    config = _row_stats_triton.RowStatsConfig(strip=32, step=8, chunk=16)
    assert _row_stats_triton.blocks((64, 64), 2, config) == (32, 8, 16)


def test_bad_input_raises():
    m, g, d = _inputs(0, (2, 8, 32), 2)
    with pytest.raises(ValueError, match="implementation must be one of"):
        accumulate_rows(m, g, d, row_axis=2, implementation="cuda")
    with pytest.raises(ValueError, match="row_axis must be 1 or 2, got 3"):
        accumulate_rows(m, g, d, row_axis=3)
    with pytest.raises(ValueError, match=r"gradient \(2, 8, 16\) must be one"):
        accumulate_rows(m, g[:, :, :16], d, row_axis=2)
    with pytest.raises(ValueError, match=r"scale must be \(batch, rows\) = \(2, 8\) for "
                                         r"row_axis=1, got \(2, 32\)"):
        accumulate_rows(m, g, d, row_axis=1)
    with pytest.raises(ValueError, match="gradient must be floating, got int32"):
        accumulate_rows(m, g.astype(jnp.int32), d, row_axis=2)
    with pytest.raises(ValueError, match=r"power-of-two divisor of at least 16, got \(8, 20\)"):
        accumulate_rows(m[:, :, :20], g[:, :, :20], d[:, :20], row_axis=2,
                        implementation="pallas_triton", interpret=True)
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match="needs an NVIDIA GPU"):
            accumulate_rows(m, g, d, row_axis=2, implementation="pallas_triton")


def test_kernel_lowers_for_h200_at_benchmark_shapes():
    """The Triton lowering succeeds for an H200 (no GPU needed; not compiled), both row axes."""
    mesh = AbstractMesh((1,), ("x",), axis_types=(AxisType.Explicit,),
                        abstract_device=AbstractDevice("NVIDIA H200", 132, "gpu"))
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    for row_axis, shape in ((2, (2, 4096, 11008)), (1, (2, 11008, 4096))):
        fn = jax.jit(functools.partial(accumulate_rows, row_axis=row_axis,
                                       implementation="pallas_triton"))
        with use_abstract_mesh(mesh):
            text = fn.trace(f32(*shape), f32(*shape), f32(shape[0], shape[row_axis])).lower(
                lowering_platforms=("cuda",)).as_text()
        assert "accumulate_rows" in text, text[:2000]


# f = 1/4 only: at f = 1 the step hands the kernel the same blocks and only sums the row sums
# it returns per matrix, which the XLA path (the goldens' f = 1 cases) covers. With the slow
# tests: the fast loop checks the kernel against its reference above.
@pytest.mark.slow
@pytest.mark.parametrize("fraction", [0.25])
def test_step_with_the_kernel_matches_the_step_with_xla(monkeypatch, fraction):
    """Three steps with the statistics kernel (interpreted) against three with XLA: the same
    momenta and updates within float32 rounding. The polar runs in float32 (standard NS): ``S``
    and the row sums, and so the payload norms, may differ in their last float32 bit, and with
    the default float16 polar a payload entry that rounds the other way moved the update by up
    to 0.4% (about one draw of inputs in seven), which would hide a real error of that size."""
    params = {"a": jnp.ones((16, 256)), "b": jnp.ones((16, 256)), "c": jnp.ones((4, 64, 32))}
    rng = np.random.default_rng(SEED)
    grads = [{k: jnp.asarray(rng.standard_normal(v.shape, np.float32))
              for k, v in params.items()} for _ in range(3)]

    def run():
        tx = dion3_jax.scale_by_dion3(fraction, orthogonalizer=dion3_jax.make_orthogonalizer(
            method="standard", compute_dtype=jnp.float32))
        state, updates = tx.init(params), []
        for g in grads:
            u, state = jax.jit(tx.update)(g, state)
            updates.append(u)
        return updates, state

    want = run()
    calls, original = [], pallas_kernels.accumulate_rows

    def kernel(*args, **kwargs):
        calls.append(kwargs["row_axis"])
        return original(*args, **{**kwargs, "implementation": "pallas_triton", "interpret": True})

    monkeypatch.setattr(_step.pallas_kernels, "accumulate_rows", kernel)
    monkeypatch.setattr(_step.pallas_kernels, "accumulate_rows_implementation",
                        lambda *_: "pallas_triton")
    got = run()
    assert calls and len(calls) % 3 == 0, calls      # one launch per leaf and trace
    for a, b in zip(jax.tree.leaves(got[1].momentum), jax.tree.leaves(want[1].momentum)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0])):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= 2e-5 * np.linalg.norm(b)
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-5 * np.abs(b).max())


@pytest.mark.parametrize("fraction", [0.25, 1.0])
def test_xla_statistics_pass_writes_s_in_place_of_a_donated_momentum(fraction):
    """With the XLA statistics pass (the CPU's), the compiled step (params and state donated)
    writes each momentum's ``S`` into the momentum's own buffer, whatever the leaf's layout (2-D
    matrices, a convolution kernel whose leading axes merge into one batch, a DenseGeneral
    kernel): no copy of a momentum-shaped array. (``S`` is summed in the leaf's shape: summed
    in its ``(batch, a, b)`` view it would need its own buffer and a copy into the donated
    one.)"""
    shapes = {"a": (64, 256), "b": (64, 256), "c": (256, 64), "conv": (3, 3, 16, 32),
              "heads": (64, 4, 32)}
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
    dims = dion3_jax.DimensionNumbers
    tx = dion3_jax.scale_by_dion3(fraction, dimension_numbers={
        "a": dims(0, 1), "b": dims(0, 1), "c": dims(0, 1), "conv": dims(-2, -1),
        "heads": dims(0, (1, 2))})
    state = jax.eval_shape(tx.init, params)

    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    text = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, params).compile().as_text()
    entry = text[text.index("ENTRY"):]
    shaped = "|".join(",".join(map(str, s)) for s in shapes.values())
    copies = re.findall(rf"= f32\[(?:{shaped})\]\S* copy\(", entry)
    assert not copies, copies
    assert "input_output_alias" in text
