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
"""The statistics pass's Mosaic GPU kernel (``pallas_kernels._row_stats_mosaic``).

Through GPU interpret mode on the CPU against the jnp reference (fresh inputs; several strips,
chunks and ring turns; non-finite and huge values; the race detector); its lowering for an H200 at
the benchmark's shapes, with ``S`` written in place of the momentum; the block choice; which
implementation ``"auto"`` and a named one resolve to. The kernel on a GPU is in
``tests/test_kernels_gpu.py``.
"""

import functools

import jax
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (_dispatch, _payload, _row_stats_mosaic,
                            accumulate_rows_implementation, accumulate_rows_reference)
from pallas_kernels._row_stats_mosaic import MosaicRowStatsConfig, accumulate_rows_mosaic
from seeds import module_seed

#: Fresh random inputs per run, printed with every test (tests/seeds.py).
SEED = module_seed()

H200 = AbstractDevice("NVIDIA H200", 132, "gpu")
#: Small blocks, so that a small matrix has two strips, two chunks and two steps per chunk.
_SMALL = {2: MosaicRowStatsConfig(strip=16, step=64, chunk=128, stages=2),
          1: MosaicRowStatsConfig(strip=64, step=16, chunk=32, stages=2)}
_SHAPES = {2: (2, 256, 32), 1: (2, 128, 64)}


def _inputs(rng, shape, row_axis, m_dtype, g_dtype):
    m = jnp.asarray(rng.standard_normal(shape, np.float32)).astype(m_dtype)
    g = jnp.asarray(rng.standard_normal(shape, np.float32)).astype(g_dtype)
    d = jnp.asarray(rng.choice([0.8145, 1.0], (shape[0], shape[row_axis])).astype(np.float32))
    return m, g, d


def _run(m, g, d, row_axis, config):
    """The kernel with its per-chunk row sums added up."""
    s, l1, sq = jax.jit(functools.partial(accumulate_rows_mosaic, row_axis=row_axis,
                                          config=config, interpret=True))(m, g, d)
    return s, jnp.sum(l1, axis=1), jnp.sum(sq, axis=1)


def _assert_matches(got, want, m, g, d, row_axis):
    """``S`` within one float32 rounding of the product (XLA may contract ``d·M + G`` into an
    FMA in one program and not the other) plus one rounding to ``M``'s dtype; NaNs where the
    reference has them; the row sums within float32 summation error."""
    s, want_s = np.asarray(got[0], np.float64), np.asarray(want[0], np.float64)
    assert got[0].dtype == m.dtype
    dm = np.expand_dims(np.asarray(d, np.float64), 3 - row_axis) * np.asarray(m, np.float64)
    bound = (2.0 ** -23 + float(jnp.finfo(m.dtype).eps)) * (abs(dm)
                                                            + abs(np.asarray(g, np.float64)))
    np.testing.assert_array_equal(np.isnan(s), np.isnan(want_s))
    finite = np.isfinite(want_s)
    np.testing.assert_array_equal(s[~finite & ~np.isnan(s)], want_s[~finite & ~np.isnan(want_s)])
    assert np.all(abs(s[finite] - want_s[finite]) <= bound[finite])
    count = m.shape[3 - row_axis]
    for a, b in zip(got[1:], want[1:]):
        assert a.shape == b.shape and a.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=count * 2.0 ** -23)


@pytest.mark.parametrize("row_axis", [1, 2])
@pytest.mark.parametrize("m_dtype,g_dtype", [(jnp.float32, jnp.bfloat16),
                                             (jnp.bfloat16, jnp.float32)])
def test_interpreted_kernel_matches_reference(row_axis, m_dtype, g_dtype):
    rng = np.random.default_rng(SEED)
    m, g, d = _inputs(rng, _SHAPES[row_axis], row_axis, m_dtype, g_dtype)
    want = accumulate_rows_reference(m, g, d, row_axis=row_axis)
    _assert_matches(_run(m, g, d, row_axis, _SMALL[row_axis]), want, m, g, d, row_axis)


@pytest.mark.parametrize("row_axis", [1, 2])
def test_interpreted_kernel_keeps_non_finite_and_saturates(row_axis):
    """An ``inf`` or NaN operand stays in ``S`` (and in its rows' sums); a finite sum past
    float32's range saturates at ``±2⁷⁹`` as the reference's does."""
    rng = np.random.default_rng(SEED)
    m, g, d = _inputs(rng, _SHAPES[row_axis], row_axis, jnp.float32, jnp.float32)
    m = m.at[0, 3, 5].set(jnp.inf).at[1, 7, 2].set(jnp.nan).at[0, 9, 9].set(3e38)
    g = g.at[0, 9, 9].set(3e38).at[1, 11, 4].set(-jnp.inf)
    want = accumulate_rows_reference(m, g, d, row_axis=row_axis)
    assert float(want[0][0, 9, 9]) == 2.0 ** 79
    _assert_matches(_run(m, g, d, row_axis, _SMALL[row_axis]), want, m, g, d, row_axis)


def test_blocks():
    """The default blocks at the 7B shapes; narrower strips or steps where the minor axis has a
    smaller power-of-two divisor; None where the kernel does not take the shape."""
    assert _row_stats_mosaic.blocks((4096, 11008), 2) == (64, 64, 256)
    assert _row_stats_mosaic.blocks((11008, 4096), 2) == (64, 64, 256)   # 11008 = 43 · 256
    assert _row_stats_mosaic.blocks((11008, 4096), 1) == (64, 64, 512)
    assert _row_stats_mosaic.blocks((4096, 11008), 1) == (64, 64, 256)
    assert _row_stats_mosaic.blocks((128, 48), 2) == (16, 64, 128)
    assert _row_stats_mosaic.blocks((40, 64), 2) is None      # 40 rows: not a multiple of 64
    assert _row_stats_mosaic.blocks((64, 24), 1) is None      # 24 columns: 8 < 16
    assert _row_stats_mosaic.blocks((64, 24), 2) is None


def test_lowers_for_h200_at_benchmark_shapes_writing_s_in_place():
    """The Mosaic GPU lowering succeeds for an H200 (no GPU needed; ptxas is not run), both row
    axes, and the custom call aliases ``S`` to the momentum operand."""
    mesh = AbstractMesh((1,), ("x",), axis_types=(AxisType.Explicit,), abstract_device=H200)
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    for row_axis, shape in ((2, (2, 4096, 11008)), (1, (2, 11008, 4096))):
        fn = jax.jit(functools.partial(accumulate_rows_mosaic, row_axis=row_axis))
        with use_abstract_mesh(mesh):
            text = fn.trace(f32(*shape), f32(*shape), f32(shape[0], shape[row_axis])).lower(
                lowering_platforms=("cuda",)).as_text()
        assert text.count("custom_call @mosaic_gpu") == 1
        assert "output_operand_alias<output_tuple_indices = [2], operand_index = 1" in text


def test_auto_and_named_implementations_resolve():
    """On an H200 ``"auto"`` takes the Mosaic kernel for a shape it takes and XLA for any
    other, even one the Pallas-Triton kernel takes (that kernel runs only by name); a named
    kernel for a shape it does not take, or on the CPU, raises."""
    mesh = AbstractMesh((1,), ("x",), axis_types=(AxisType.Explicit,), abstract_device=H200)
    with use_abstract_mesh(mesh):
        assert accumulate_rows_implementation((4096, 4096), 2, "auto") == "mosaic"
        assert accumulate_rows_implementation((4096, 4096), 1, "auto") == "mosaic"
        assert accumulate_rows_implementation((4096, 4096), 2, "mosaic") == "mosaic"
        assert accumulate_rows_implementation((40, 20), 2, "auto") == "xla"
        assert accumulate_rows_implementation((40, 64), 2, "auto") == "xla"
        assert accumulate_rows_implementation((40, 64), 2, "pallas_triton") == "pallas_triton"
        with pytest.raises(ValueError, match=r"'mosaic' needs an extent along axis 1 that is a "
                                             r"multiple of 64.*got \(40, 64\)"):
            accumulate_rows_implementation((40, 64), 2, "mosaic")
    with pytest.raises(ValueError, match=r"'mosaic' needs a Hopper GPU \(sm_90\); the target "
                                         r"is 'cpu'"):
        accumulate_rows_implementation((4096, 4096), 2, "mosaic")
    assert accumulate_rows_implementation((4096, 4096), 2, "mosaic", interpret=True) == "mosaic"


def test_auto_takes_the_mosaic_kernel_on_a_jax_without_the_triton_lowering(monkeypatch):
    """Where jax has dropped Pallas' Triton lowering, ``"auto"`` still runs a kernel on Hopper:
    the Mosaic one (and the step lowers without the old lowering)."""
    real = _dispatch.available_implementations
    monkeypatch.setattr(_dispatch, "available_implementations",
                        lambda device=None: tuple(n for n in real(device) if n != "pallas_triton"))
    mesh = AbstractMesh((1,), ("x",), axis_types=(AxisType.Explicit,), abstract_device=H200)
    with use_abstract_mesh(mesh):
        assert accumulate_rows_implementation((4096, 4096), 2, "auto") == "mosaic"
        assert _payload.implementation_for((4096, 4096), "auto", every_row=True) == "mosaic"
        assert _payload.implementation_for((4096, 4096), "auto") == "xla"


def _xla_polar():
    import dion3_jax

    return dion3_jax.make_orthogonalizer(backend="xla")


def _step_for_h200(fraction, **kwargs):
    """The step's StableHLO for an H200 and the warnings raised while lowering it (two shape
    groups, ``(128, 320)`` and ``(320, 128)``)."""
    import warnings

    import dion3_jax

    mesh = AbstractMesh((1,), ("x",), axis_types=(AxisType.Explicit,), abstract_device=H200)
    params = {"up": jax.ShapeDtypeStruct((128, 320), jnp.float32),
              "down": jax.ShapeDtypeStruct((320, 128), jnp.float32)}
    with use_abstract_mesh(mesh), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tx = dion3_jax.dion3(0.01, fraction, **kwargs)
        state = jax.eval_shape(tx.init, params)
        text = jax.jit(tx.update).trace(params, state, params).lower(
            lowering_platforms=("cuda",)).as_text()
    return text, [str(w.message) for w in caught]


# The fast loop: the default ("auto"); the named "mosaic" with the slow tests.
@pytest.mark.parametrize("pass_implementation",
                         ["auto", pytest.param("mosaic", marks=pytest.mark.slow)])
@pytest.mark.parametrize("fraction", [0.25, 1.0])
def test_the_step_lowers_for_h200_with_mosaic_passes_and_no_warning(fraction,
                                                                     pass_implementation):
    """By default (and with ``"mosaic"``) the step lowers for an H200 with Mosaic GPU kernels
    for both statistics passes, and at f = 1 for both groups' payload passes too (at f = 1/4
    the payload of selected rows is XLA's), with no Pallas-Triton kernel, and lowering it warns
    of nothing (the same check sees the Pallas-Triton lowering's deprecation notice)."""
    text, caught = _step_for_h200(fraction, pass_implementation=pass_implementation,
                                  orthogonalizer=_xla_polar())
    want = 4 if fraction == 1.0 else 2
    assert text.count("custom_call @mosaic_gpu") == want, text.count("custom_call @mosaic_gpu")
    assert "triton" not in text
    assert not caught, caught


def test_the_step_with_default_arguments_lowers_for_h200_without_warnings():
    """Every argument at its default (the polar's products included): no Pallas-Triton kernel
    and no warning when the step lowers for an H200."""
    for fraction in (0.25, 1.0):
        text, caught = _step_for_h200(fraction)
        assert "custom_call @mosaic_gpu" in text
        assert "triton" not in text
        assert not caught, caught


def test_the_warning_check_sees_the_triton_lowerings_notice():
    """The checks above can fail: named, the Pallas-Triton kernels are in the step and their
    lowering warns."""
    text, caught = _step_for_h200(1.0, pass_implementation="pallas_triton",
                                  orthogonalizer=_xla_polar())
    assert "triton" in text
    assert any("Pallas Triton backend is deprecated" in w for w in caught), caught


@pytest.mark.parametrize("row_axis", [1, 2])
def test_interpreted_kernel_has_no_data_race(row_axis):
    """GPU interpret mode's race detector (the ring's TMA copies against the warpgroup's
    shared-memory reads and writes) finds none over two ring turns."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    rng = np.random.default_rng(SEED)
    m, g, d = _inputs(rng, _SHAPES[row_axis], row_axis, jnp.float32, jnp.float32)
    jax.block_until_ready(accumulate_rows_mosaic(
        m, g, d, row_axis=row_axis, config=_SMALL[row_axis],
        interpret=InterpretGPUParams(detect_races=True)))
    assert interpret_pallas_call.get_races().races_found is False
