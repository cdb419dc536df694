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
"""Symmetric products (pallas_kernels): the shared accuracy suite, the XLA path, backend selection
and the Mosaic GPU kernel through GPU interpret mode (CPU), each against the jnp reference.

``KernelSuite`` is run once per backend: here for "xla" and for "mosaic" in interpret mode on small
shapes; ``test_kernels_gpu.py`` runs it for the compiled kernels on a GPU.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import _api, _dispatch
from seeds import module_seed


#: Every run draws fresh inputs: ``fresh_key(i)`` is ``jax.random.key(SEED + i)`` (printed with
#: each test by ``conftest.print_module_seed``).
SEED = module_seed()


def fresh_key(offset: int) -> jax.Array:
    return jax.random.key(SEED + offset)


def rel_error(out, ref64) -> float:
    """Relative Frobenius error of ``out`` against a float64 reference."""
    out64 = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    return float(np.linalg.norm(out64 - ref64) / np.linalg.norm(ref64))


def assert_tiles_mirrored(out, dtype, tile: int = 128, diagonal_exact: bool = False):
    """Elements in different ``tile × tile`` blocks equal their mirror exactly; inside a
    diagonal block exactly too when ``diagonal_exact``, else up to one rounding of ``dtype``
    (a ``sym_matmul`` of matrices that commute only up to rounding)."""
    out = np.asarray(jnp.asarray(out, jnp.float32))
    mirror = np.swapaxes(out, -1, -2)
    block = np.arange(out.shape[-1]) // tile
    inside = block[:, None] == block[None, :]
    np.testing.assert_array_equal(np.where(inside, 0, out), np.where(inside, 0, mirror))
    if diagonal_exact:
        np.testing.assert_array_equal(out, mirror)
    else:
        ulp = float(jnp.finfo(dtype).eps) * np.abs(out).max()
        assert np.abs(out - mirror).max() <= 2 * ulp, (np.abs(out - mirror).max(), ulp)


def gram_inputs(key, shape, dtype):
    """Random ``x`` of ``shape`` in ``dtype`` and its float64 Gram ``x xᵀ`` (default device)."""
    x = jax.random.normal(key, shape, jnp.float32).astype(dtype)
    with jax.enable_x64(True):
        x64 = x.astype(jnp.float64)
        ref = jnp.einsum("...ik,...jk->...ij", x64, x64, precision="highest")
    return x, np.asarray(ref)


def commuting_inputs(key, batch, n, dtype, alpha, beta):
    """Commuting symmetric ``a, b`` (polynomials of one Gram matrix), symmetric ``c``, and
    the float64 ``alpha·a·b + beta·c`` from the rounded operands."""
    with jax.enable_x64(True):
        mm = lambda u, v: jnp.matmul(u, v, precision="highest")
        x = jax.random.normal(key, (*batch, n, 2 * n + 3), jnp.float64)
        g = mm(x, jnp.swapaxes(x, -1, -2))
        g = g / jnp.linalg.norm(g, axis=(-2, -1), keepdims=True)
        eye = jnp.eye(n, dtype=jnp.float64)
        a, b, c = (v.astype(dtype) for v in (3.0 * eye - 2.0 * g, 0.5 * g + mm(g, g), eye + g))
        a64, b64, c64 = (v.astype(jnp.float64) for v in (a, b, c))
        ref = np.asarray(alpha * mm(a64, b64) + beta * c64)
    return a, b, c, ref


def xla_error_syrk(x, ref64, out_dtype):
    """The error of the jnp reference (the "xla" implementation) against float64."""
    return rel_error(pallas_kernels.syrk_reference(x, out_dtype=out_dtype), ref64)


class KernelSuite:
    """Accuracy and symmetry checks shared by every backend (subclasses set the attributes).

    Each backend's error against a float64 product must stay within ``ERROR_FACTOR`` times the
    error of the jnp reference (``pallas_kernels.syrk_reference`` / ``sym_matmul_reference``)
    on the same rounded operands. A kernel's ``syrk`` must be exactly symmetric (where
    ``SYRK_EXACT``), its ``sym_matmul`` exactly mirrored across tiles (and inside diagonal tiles
    where ``SYM_DIAGONAL_EXACT``).
    """

    IMPLEMENTATION = "xla"
    SYRK_EXACT = True
    SYM_DIAGONAL_EXACT = True
    INTERPRET = False
    SYRK_SHAPES = [(64, 48), (128, 128), (200, 72)]
    SYM_SIZES = [((), 64), ((), 200)]
    DTYPES = [jnp.float16, jnp.bfloat16]
    ERROR_FACTOR = 2.0  # Kernel error <= ERROR_FACTOR · XLA's own error for the same dtype.
    EVERY_DTYPE_PER_SHAPE = True  # False: the dtypes take turns over the shapes (slow backends).

    def shapes_and_dtypes(self, shapes):
        """``(shape, dtype)`` pairs: every dtype on every shape, or one dtype per shape in
        turn (each dtype still meets the kernel, on other shapes)."""
        if self.EVERY_DTYPE_PER_SHAPE:
            return [(shape, dtype) for shape in shapes for dtype in self.DTYPES]
        return [(shape, self.DTYPES[i % len(self.DTYPES)]) for i, shape in enumerate(shapes)]

    def syrk(self, x, **kw):
        return pallas_kernels.syrk(x, implementation=self.IMPLEMENTATION,
                                   interpret=self.INTERPRET, **kw)

    def assert_syrk_symmetric(self, out, dtype):
        """Exactly symmetric where ``SYRK_EXACT``; else within one rounding of ``dtype``."""
        mirror = np.swapaxes(out, -1, -2)
        if self.SYRK_EXACT:
            np.testing.assert_array_equal(out, mirror)
        else:
            eps = float(jnp.finfo(dtype).eps)
            np.testing.assert_allclose(out, mirror, rtol=eps, atol=eps * np.abs(out).max())

    def sym_matmul(self, a, b, c=None, **kw):
        return pallas_kernels.sym_matmul(a, b, c, implementation=self.IMPLEMENTATION,
                                         interpret=self.INTERPRET, **kw)

    def test_syrk_accuracy_and_symmetry(self):
        for s, (shape, dtype) in enumerate(self.shapes_and_dtypes(self.SYRK_SHAPES)):
            x, ref = gram_inputs(fresh_key(100 + s), shape, dtype)
            out = self.syrk(x)
            assert out.shape == shape[:-1] + shape[-2:-1] and out.dtype == dtype
            out = np.asarray(out.astype(jnp.float32))
            assert np.all(np.isfinite(out)), (shape, dtype)
            self.assert_syrk_symmetric(out, dtype)
            err, xla_err = rel_error(out, ref), xla_error_syrk(x, ref, dtype)
            assert err <= self.ERROR_FACTOR * xla_err + 1e-6, (shape, dtype, err, xla_err)

    def test_syrk_transpose_reads_a_tall_matrix(self):
        """``syrk(xᵀ, transpose=True)`` is ``x · xᵀ``, from the transposed array itself: as
        accurate as the reference and exactly symmetric."""
        for s, shape in enumerate(self.SYRK_SHAPES[:2]):
            x, ref = gram_inputs(fresh_key(150 + s), shape, jnp.float16)
            tall = jnp.swapaxes(x, -1, -2)
            out = self.syrk(tall, transpose=True)
            assert out.shape == shape[:-1] + shape[-2:-1] and out.dtype == jnp.float16
            out = np.asarray(out.astype(jnp.float32))
            self.assert_syrk_symmetric(out, jnp.float16)
            err, xla_err = rel_error(out, ref), xla_error_syrk(x, ref, jnp.float16)
            assert err <= self.ERROR_FACTOR * xla_err + 1e-6, (shape, err, xla_err)

    def test_syrk_float32_output(self):
        x, ref = gram_inputs(fresh_key(7), self.SYRK_SHAPES[-1], jnp.bfloat16)
        out = self.syrk(x, out_dtype=jnp.float32)
        assert out.dtype == jnp.float32
        self.assert_syrk_symmetric(np.asarray(out), jnp.float32)
        xla = pallas_kernels.syrk_reference(x, out_dtype=jnp.float32)
        xla_err = rel_error(xla, ref)
        # float32 accumulation error only (~1e-6): compare with XLA's, plus float32 slack.
        assert rel_error(out, ref) <= self.ERROR_FACTOR * xla_err + 1e-6

    def test_sym_matmul_accuracy_and_symmetry(self):
        cases = [(1.0, 0.0, False), (2.0, -0.5, True), (-1.5, 3.0, True)]
        for s, ((batch, n), dtype) in enumerate(self.shapes_and_dtypes(self.SYM_SIZES)):
            for alpha, beta, use_c in cases:
                a, b, c, ref = commuting_inputs(fresh_key(200 + s), batch, n, dtype,
                                                alpha, beta if use_c else 0.0)
                c = c if use_c else None
                kw = dict(alpha=alpha, beta=beta)
                out = self.sym_matmul(a, b, c, **kw)
                assert out.shape == (*batch, n, n) and out.dtype == dtype
                out = np.asarray(out.astype(jnp.float32))
                assert np.all(np.isfinite(out))
                if self.IMPLEMENTATION != "xla":
                    assert_tiles_mirrored(out, dtype, diagonal_exact=self.SYM_DIAGONAL_EXACT)
                xla = pallas_kernels.sym_matmul_reference(a, b, c, **kw)
                err, xla_err = rel_error(out, ref), rel_error(xla, ref)
                assert err <= self.ERROR_FACTOR * xla_err + 1e-6, (n, dtype, alpha, err,
                                                                   xla_err)


class TestXla(KernelSuite):
    IMPLEMENTATION = "xla"
    # XLA's dot does not promise one summation order for (i, j) and (j, i): on the CPU, xᵀx of
    # a tall x came out one float16 rounding apart across the diagonal for some inputs.
    SYRK_EXACT = False
    SYRK_SHAPES = [(64, 48), (3, 33, 17), (2, 2, 50, 20)]
    SYM_SIZES = [((), 40), ((3,), 24)]
    DTYPES = [jnp.float16, jnp.bfloat16, jnp.float32]

    def test_matches_float64_numpy(self):
        x = np.random.default_rng(SEED).standard_normal((2, 30, 50))
        out = pallas_kernels.syrk(jnp.asarray(x, jnp.float32), implementation="xla")
        np.testing.assert_allclose(np.asarray(out), x @ np.swapaxes(x, -1, -2), rtol=1e-5,
                                   atol=1e-4)


# ----------------------------------------------------------------------------------------------
# Backend selection.


def test_available_implementations_on_this_backend():
    names = pallas_kernels.available_implementations()
    assert names[0] == "xla"
    if jax.default_backend() == "cpu":
        assert names == ("xla",)


def test_unknown_implementation_raises():
    x = jnp.ones((8, 8), jnp.float16)
    with pytest.raises(ValueError, match="implementation must be one of"):
        pallas_kernels.syrk(x, implementation="cublas")
    with pytest.raises(ValueError, match="implementation must be one of"):
        pallas_kernels.sym_matmul(x, x, implementation="triton")
    with pytest.raises(ValueError, match="has no 'pallas_triton' kernel"):
        pallas_kernels.sym_matmul(x, x, implementation="pallas_triton")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU fallbacks")
def test_named_kernels_raise_on_cpu():
    x = jnp.ones((256, 256), jnp.float16)
    for impl in ("mosaic", "jax_triton"):
        with pytest.raises(ValueError, match="the target is 'cpu'"):
            pallas_kernels.syrk(x, implementation=impl)
        with pytest.raises(ValueError, match="the target is 'cpu'"):
            pallas_kernels.sym_matmul(x, x, implementation=impl)


def test_triton_has_no_interpret_mode():
    x = jnp.ones((64, 64), jnp.float16)
    with pytest.raises(ValueError, match="no interpret mode"):
        pallas_kernels.syrk(x, implementation="jax_triton", interpret=True)


@pytest.mark.parametrize("impl", ["mosaic", "jax_triton"])
def test_kernels_reject_non_16_bit(impl):
    x = jnp.ones((64, 64), jnp.float32)
    with pytest.raises(ValueError, match="float16/bfloat16"):
        pallas_kernels.syrk(x, implementation=impl)


def test_auto_resolution(monkeypatch):
    f16 = (jnp.float16,)
    big = _api.AUTO_MIN_WORK
    assert _api._work((32, 1024, 4096)) == 32 * 1024 * 1024 * 4096
    assert _api._work((32, 512, 512)) == big  # the f = 1/8 step's 512² Gram iterations (7B shapes)
    assert _api._work((8, 1024, 1024)) > big  # the f = 1/4 down projections
    assert _api._resolve("xla", dtypes=f16, size=big, interpret=False) == "xla"
    monkeypatch.setattr(_dispatch, "available_implementations", lambda: ("xla",))
    assert _api._resolve("auto", dtypes=f16, size=big, interpret=False) == "xla"
    monkeypatch.setattr(_dispatch, "available_implementations",
                        lambda: ("xla", "mosaic", "jax_triton"))
    monkeypatch.setattr(_dispatch, "is_hopper", lambda device: True)
    assert _api._resolve("auto", dtypes=f16, size=big, interpret=False) == "mosaic"
    assert _api._resolve("auto", dtypes=f16, size=big - 1, interpret=False) == "xla"
    assert _api._resolve("auto", dtypes=(jnp.float32,), size=big, interpret=False) == "xla"
    monkeypatch.setattr(_dispatch, "is_hopper", lambda device: False)
    assert _api._resolve("auto", dtypes=f16, size=big, interpret=False) == "jax_triton"


def test_mosaic_products_of_one_shape_share_a_kernel():
    """Products of one shape with different ``α, β`` lower to one Mosaic GPU kernel (the scales
    are run-time operands), not one per pair: a Gram Newton-Schulz polar makes about 14 such
    products per shape, and each kernel costs seconds of compile time. Lowered for sm_90 on the
    CPU; ptxas is not run."""
    from pallas_kernels._mosaic import MosaicConfig, sym_matmul_mosaic

    config = dataclasses.replace(MosaicConfig.get_default(), num_sms=132)

    def three(a, b, c):
        x = sym_matmul_mosaic(a, b, c, alpha=2.0, beta=0.5, config=config)
        y = sym_matmul_mosaic(a, x, c, alpha=1.0, beta=-3.0, config=config)
        return sym_matmul_mosaic(y, y, x, alpha=0.25, beta=1.5, config=config)

    f16 = jax.ShapeDtypeStruct((256, 256), jnp.float16)
    text = jax.jit(three).trace(f16, f16, f16).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1
    assert text.count("call @sym_matmul_mosaic(") == 3


def test_shape_errors():
    a = jnp.ones((8, 4), jnp.float16)
    with pytest.raises(ValueError, match="need a"):
        pallas_kernels.sym_matmul(a, a)
    with pytest.raises(ValueError, match="c must be"):
        pallas_kernels.sym_matmul(a, a.T, jnp.ones((4, 4), jnp.float16))


def test_auto_on_cpu_is_the_reference_and_jits():
    x = jax.random.normal(fresh_key(0), (3, 40, 24), jnp.bfloat16)
    out = jax.jit(pallas_kernels.syrk)(x)
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)),
                                  np.asarray(pallas_kernels.syrk_reference(x).astype(jnp.float32)))


# ----------------------------------------------------------------------------------------------
# The Mosaic GPU kernel through GPU interpret mode (jax 0.11.2 supports it; private import).


class _OrderedMatmulNumpy:
    """``numpy`` whose ``matmul`` sums every output element over ``k`` in one fixed order.

    GPU interpret mode emulates ``wgmma`` with the host's ``np.matmul``; a BLAS ``sgemm`` may sum
    ``(i, j)`` and ``(j, i)`` of ``a · aᵀ`` in different orders (OpenBLAS 0.3.34 on an AMD EPYC
    does, for float16 operands), which the tensor cores do not, so a ``syrk`` diagonal tile would
    come out asymmetric on the host only. ``np.einsum`` without ``optimize`` loops in one order.
    """

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def matmul(a, b, dtype=None):
        return np.einsum("...ik,...kj->...ij", a.astype(dtype), b.astype(dtype))


@pytest.mark.slow
class TestMosaicInterpret(KernelSuite):
    IMPLEMENTATION = "mosaic"
    INTERPRET = True
    SYM_DIAGONAL_EXACT = False
    SYRK_SHAPES = [(64, 48), (128, 64), (200, 72), (2, 136, 80)]
    # 130 pads to two tiles like 200 would (and is batched).
    SYM_SIZES = [((), 64), ((2,), 130)]
    DTYPES = [jnp.float16, jnp.bfloat16]
    # Interpreting is slow: float16 and bfloat16 take turns (4 syrk calls, 6 products).
    EVERY_DTYPE_PER_SHAPE = False

    @pytest.fixture(autouse=True)
    def _ordered_host_matmul(self, monkeypatch):
        from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

        monkeypatch.setattr(gpu_callbacks, "np", _OrderedMatmulNumpy())

    def test_every_element_written_and_no_races(self):
        """Interpret mode fills fresh buffers with NaN: a tile-aligned output shows every write.

        Fewer CTAs than work items (each CTA walks several), tile grids with T = 2, 3, 5 (the
        paired walk's singles and all of its sections but the quads' neighbors) and a batch, and
        contractions long enough that the pipeline ring wraps (k_iters > stages); the race
        detector watches every shared-memory access. Symmetry (exact for ``syrk``, across tiles
        for ``sym_matmul``) and error <= 2x the reference's against float64."""
        from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

        from pallas_kernels._mosaic import MosaicConfig, sym_matmul_mosaic, syrk_mosaic

        config = MosaicConfig(num_sms=3)
        params = InterpretGPUParams(detect_races=True, uninitialized_memory="nan")
        for s, (shape, dtype) in enumerate([((384, 640), jnp.float16), ((520, 200), jnp.bfloat16),
                                            ((2, 256, 320), jnp.float16)]):
            x, ref = gram_inputs(fresh_key(300 + s), shape, dtype)
            out = np.asarray(syrk_mosaic(x, config=config, interpret=params), np.float32)
            assert not np.isnan(out).any(), shape
            assert not interpret_pallas_call.get_races().races_found, shape
            np.testing.assert_array_equal(out, np.swapaxes(out, -1, -2))
            err, ref_err = rel_error(out, ref), xla_error_syrk(x, ref, dtype)
            assert err <= 2.0 * ref_err + 1e-6, (shape, err, ref_err)
        for s, (batch, n, alpha, beta) in enumerate([((), 384, 2.0, -0.5), ((2,), 256, 1.0, 0.0)]):
            a, b, c, ref = commuting_inputs(fresh_key(400 + s), batch, n, jnp.bfloat16, alpha,
                                            beta)
            kw = dict(alpha=alpha, beta=beta)
            out = np.asarray(sym_matmul_mosaic(a, b, c, config=config, interpret=params, **kw),
                             np.float32)
            assert not np.isnan(out).any(), n
            assert not interpret_pallas_call.get_races().races_found, n
            assert_tiles_mirrored(out, jnp.bfloat16)
            err, ref_err = rel_error(out, ref), rel_error(
                pallas_kernels.sym_matmul_reference(a, b, c, **kw), ref)
            assert err <= 2.0 * ref_err + 1e-6, (n, err, ref_err)

    def test_quads_and_interior_blocks(self):
        """T = 8: two diagonal 4×4-tile blocks (5 items each) and the blocks between them."""
        from pallas_kernels._mosaic import MosaicConfig, syrk_mosaic

        # k = 128: two contraction steps per item, the pipelined path (one step alone would
        # take the single-stage one), and the fewest steps to interpret for each of 18 items.
        x, ref = gram_inputs(fresh_key(9), (1000, 128), jnp.float16)
        out = np.asarray(syrk_mosaic(x, config=MosaicConfig(num_sms=5), interpret=True),
                         np.float32)
        np.testing.assert_array_equal(out, out.T)
        assert rel_error(out, ref) <= 2.0 * xla_error_syrk(x, ref, jnp.float16) + 1e-6

    def test_float32_output_matches_the_reference(self):
        """With a float32 output the kernel and its jnp reference differ only in the order of
        their float32 sums (16-bit products are exact in float32): a small multiple of float32
        rounding of the largest entry, where a wrong tile would be off by the entries' size."""
        from pallas_kernels._mosaic import sym_matmul_mosaic, syrk_mosaic

        def close(out, ref, rel):
            ref = np.asarray(ref)
            np.testing.assert_allclose(np.asarray(out), ref, rtol=0,
                                       atol=rel * np.abs(ref).max())

        x = jax.random.normal(fresh_key(21), (2, 136, 200), jnp.float32).astype(jnp.bfloat16)
        close(syrk_mosaic(x, out_dtype=jnp.float32, interpret=True),
              pallas_kernels.syrk_reference(x, out_dtype=jnp.float32), 1e-5)
        a, b, c, _ = commuting_inputs(fresh_key(22), (), 200, jnp.float16, 1.0, 1.0)
        kw = dict(alpha=-1.5, beta=0.25, out_dtype=jnp.float32)
        close(sym_matmul_mosaic(a, b, c, interpret=True, **kw),
              pallas_kernels.sym_matmul_reference(a, b, c, **kw), 5e-4)

    def test_traced_scales(self):
        """``α`` and ``β`` may be traced (the kernel reads them at run time): one jitted kernel
        with scales as arguments matches the reference at two pairs of scales."""
        from pallas_kernels._mosaic import sym_matmul_mosaic

        a, b, c, _ = commuting_inputs(fresh_key(23), (), 64, jnp.float16, 1.0, 1.0)
        run = jax.jit(lambda al, be: sym_matmul_mosaic(a, b, c, alpha=al, beta=be,
                                                       out_dtype=jnp.float32, interpret=True))
        for al, be in [(2.0, -0.5), (-0.75, 3.0)]:
            ref = np.asarray(pallas_kernels.sym_matmul_reference(
                a, b, c, alpha=al, beta=be, out_dtype=jnp.float32))
            np.testing.assert_allclose(np.asarray(run(jnp.float32(al), jnp.float32(be))), ref,
                                       rtol=0, atol=5e-4 * np.abs(ref).max())

    def test_one_contraction_step_with_several_items_per_cta(self):
        """One contraction step per item (k <= tile_k) with one CTA walking every item: jax's
        pipeline then runs a single stage, so slots are released at once and each step waits
        for its wgmma (``_mosaic._in_flight``). With the one-step-late release kept there, the
        interpreter reported a compute warpgroup that missed a barrier phase (a load could
        overwrite a panel in use). Race detector on; exact symmetry; accuracy as XLA's."""
        from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

        from pallas_kernels._mosaic import MosaicConfig, syrk_mosaic

        params = InterpretGPUParams(detect_races=True, uninitialized_memory="nan")
        cases = [((384, 64), jnp.float16), ((2, 256, 40), jnp.bfloat16)]
        for s, (shape, dtype) in enumerate(cases):
            x, ref = gram_inputs(fresh_key(900 + s), shape, dtype)
            out = np.asarray(syrk_mosaic(x, config=MosaicConfig(num_sms=1), interpret=params),
                             np.float32)
            assert not np.isnan(out).any(), shape
            assert not interpret_pallas_call.get_races().races_found, shape
            np.testing.assert_array_equal(out, np.swapaxes(out, -1, -2))
            err, ref_err = rel_error(out, ref), xla_error_syrk(x, ref, dtype)
            assert err <= 2.0 * ref_err + 1e-6, (shape, err, ref_err)

    def test_shallowest_pipeline(self):
        """Two stages (the least that keeps one wgmma group in flight) and 16-deep panels."""
        from pallas_kernels._mosaic import MosaicConfig, syrk_mosaic

        x, ref = gram_inputs(fresh_key(5), (130, 96), jnp.float16)
        config = MosaicConfig(tile_k=16, max_concurrent_steps=2)
        out = syrk_mosaic(x, config=config, interpret=True)
        assert rel_error(out, ref) <= 2.0 * xla_error_syrk(x, ref, jnp.float16) + 1e-6

    def test_config_validation(self):
        from pallas_kernels._mosaic import MosaicConfig

        with pytest.raises(ValueError, match="tile=96"):
            MosaicConfig(tile=96)
        with pytest.raises(ValueError, match="tile_k=8"):
            MosaicConfig(tile_k=8)
        with pytest.raises(ValueError, match="max_concurrent_steps=1"):
            MosaicConfig(max_concurrent_steps=1)
        with pytest.raises(ValueError, match="num_sms=0"):
            MosaicConfig(num_sms=0)

    def test_default_config_fits_shared_memory(self):
        """A float32 output gets a shallower pipeline than a 16-bit one."""
        from pallas_kernels._mosaic import SMEM_LIMIT, MosaicConfig, smem_bytes

        for in_dtype in (jnp.float16, jnp.bfloat16):
            for out_dtype, stages in ((in_dtype, 4), (jnp.float32, 3)):
                config = MosaicConfig.get_default(in_dtype, out_dtype)
                assert (config.tile, config.tile_k) == pallas_kernels.TILE_MULTIPLES
                assert config.max_concurrent_steps == stages, (in_dtype, out_dtype, config)
                assert smem_bytes(config, in_dtype, out_dtype) <= SMEM_LIMIT
                deeper = dataclasses.replace(config, max_concurrent_steps=stages + 1)
                assert smem_bytes(deeper, in_dtype, out_dtype) > SMEM_LIMIT

    def test_config_over_shared_memory_raises(self):
        """An explicit configuration that cannot fit says so before anything is launched (4
        stages with float32 outputs: 262144 > 231424 bytes)."""
        from pallas_kernels._mosaic import MosaicConfig, syrk_mosaic

        x = jnp.ones((128, 64), jnp.float16)
        with pytest.raises(ValueError, match="262144 bytes of shared memory"):
            syrk_mosaic(x, out_dtype=jnp.float32, config=MosaicConfig(), interpret=True)
        out = syrk_mosaic(x, out_dtype=jnp.float32, interpret=True)  # The default fits.
        np.testing.assert_allclose(np.asarray(out), 64.0)

    @pytest.mark.parametrize("out", [jnp.float16, jnp.float32])
    def test_lowers_for_sm90_at_headline_shapes(self, out):
        """The Mosaic GPU lowering (layout inference, shared-memory budget) succeeds for sm_90 on
        CPU at the benchmark's headline shapes; ptxas is not run."""
        from pallas_kernels._mosaic import MosaicConfig, sym_matmul_mosaic, syrk_mosaic

        config = dataclasses.replace(MosaicConfig.get_default(jnp.float16, out), num_sms=132)
        f16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float16)
        jax.jit(lambda x: syrk_mosaic(x, out_dtype=out, config=config)).trace(
            f16(4096, 16384)).lower(lowering_platforms=("cuda",))
        jax.jit(lambda x: syrk_mosaic(x, transpose=True, out_dtype=out, config=config)).trace(
            f16(16384, 4096)).lower(lowering_platforms=("cuda",))
        jax.jit(lambda a, b, c: sym_matmul_mosaic(a, b, c, alpha=1.0, beta=0.5, out_dtype=out,
                                                  config=config)).trace(
            f16(4096, 4096), f16(4096, 4096), f16(4096, 4096)).lower(lowering_platforms=("cuda",))


@pytest.mark.slow  # ~3 s: two Mosaic GPU kernels lowered
def test_the_steps_polar_lowers_one_kernel_per_product_kind(monkeypatch):
    """Inside the whole step (a shard_map), the Gram polar's 14 products of one shape lower one
    ``sym_matmul`` kernel and its Gram matrices one ``syrk`` kernel, with the steps' coefficients
    passed as operands (scales of mixed kinds, Python floats beside traced arrays, once traced
    two kernels per shape). Lowered for an abstract H200 on the CPU; ptxas is not run."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

    import dion3_jax
    from pallas_kernels import _dispatch

    monkeypatch.setattr(_dispatch, "is_hopper", lambda device: device.platform == "gpu")
    mesh = AbstractMesh((1,), ("x",), axis_types=(AxisType.Explicit,),
                        abstract_device=AbstractDevice("NVIDIA H200", 132, "gpu"))
    params = {"up": jax.ShapeDtypeStruct((128, 320), jnp.float32)}
    with use_abstract_mesh(mesh):
        tx = dion3_jax.dion3(0.01, 1.0, orthogonalizer=dion3_jax.make_orthogonalizer(
            backend="mosaic"), pass_implementation="xla")
        state = jax.eval_shape(tx.init, params)
        text = jax.jit(tx.update).trace(params, state, params).lower(
            lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 2, text.count("custom_call @mosaic_gpu")
