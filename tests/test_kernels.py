"""Symmetric products (pallas_kernels): the shared accuracy suite, the XLA path, backend selection
and the Mosaic GPU kernel through GPU interpret mode (CPU).

``KernelSuite`` is run once per backend: here for "xla" and for "mosaic" in interpret mode on small
shapes; ``test_kernels_gpu.py`` runs it for the compiled kernels on a GPU.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import _api


def rel_error(out, ref64) -> float:
    """Relative Frobenius error of ``out`` against a float64 reference."""
    out64 = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    return float(np.linalg.norm(out64 - ref64) / np.linalg.norm(ref64))


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
    return rel_error(pallas_kernels.syrk(x, out_dtype=out_dtype, implementation="xla"), ref64)


class KernelSuite:
    """Accuracy and symmetry checks shared by every backend (subclasses set the attributes)."""

    IMPLEMENTATION = "xla"
    INTERPRET = False
    SYRK_SHAPES = [(64, 48), (128, 128), (200, 72)]
    SYM_SIZES = [((), 64), ((), 200)]
    DTYPES = [jnp.float16, jnp.bfloat16]
    ERROR_FACTOR = 2.0  # Kernel error <= ERROR_FACTOR · XLA's own error for the same dtype.

    def syrk(self, x, **kw):
        return pallas_kernels.syrk(x, implementation=self.IMPLEMENTATION,
                                   interpret=self.INTERPRET, **kw)

    def sym_matmul(self, a, b, c=None, **kw):
        return pallas_kernels.sym_matmul(a, b, c, implementation=self.IMPLEMENTATION,
                                         interpret=self.INTERPRET, **kw)

    def test_syrk_accuracy_and_symmetry(self):
        for s, shape in enumerate(self.SYRK_SHAPES):
            for dtype in self.DTYPES:
                x, ref = gram_inputs(jax.random.key(100 + s), shape, dtype)
                out = self.syrk(x)
                assert out.shape == shape[:-1] + shape[-2:-1] and out.dtype == dtype
                out = np.asarray(out.astype(jnp.float32))
                assert np.all(np.isfinite(out)), (shape, dtype)
                np.testing.assert_array_equal(out, np.swapaxes(out, -1, -2))
                err, xla_err = rel_error(out, ref), xla_error_syrk(x, ref, dtype)
                assert err <= self.ERROR_FACTOR * xla_err + 1e-6, (shape, dtype, err, xla_err)

    def test_syrk_float32_output(self):
        x, ref = gram_inputs(jax.random.key(7), self.SYRK_SHAPES[-1], jnp.bfloat16)
        out = self.syrk(x, out_dtype=jnp.float32)
        assert out.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(out), np.swapaxes(np.asarray(out), -1, -2))
        xla = pallas_kernels.syrk(x, out_dtype=jnp.float32, implementation="xla")
        xla_err = rel_error(xla, ref)
        # float32 accumulation error only (~1e-6): compare with XLA's, plus float32 slack.
        assert rel_error(out, ref) <= self.ERROR_FACTOR * xla_err + 1e-6

    def test_sym_matmul_accuracy_and_symmetry(self):
        cases = [(1.0, 0.0, False), (2.0, -0.5, True), (-1.5, 3.0, True)]
        for s, (batch, n) in enumerate(self.SYM_SIZES):
            for dtype in self.DTYPES:
                for alpha, beta, use_c in cases:
                    a, b, c, ref = commuting_inputs(jax.random.key(200 + s), batch, n, dtype,
                                                    alpha, beta if use_c else 0.0)
                    c = c if use_c else None
                    kw = dict(alpha=alpha, beta=beta)
                    out = self.sym_matmul(a, b, c, **kw)
                    assert out.shape == (*batch, n, n) and out.dtype == dtype
                    out = np.asarray(out.astype(jnp.float32))
                    assert np.all(np.isfinite(out))
                    if self.IMPLEMENTATION != "xla":
                        np.testing.assert_array_equal(out, np.swapaxes(out, -1, -2))
                    xla = pallas_kernels.sym_matmul(a, b, c, implementation="xla", **kw)
                    err, xla_err = rel_error(out, ref), rel_error(xla, ref)
                    assert err <= self.ERROR_FACTOR * xla_err + 1e-6, (n, dtype, alpha, err,
                                                                       xla_err)


class TestXla(KernelSuite):
    IMPLEMENTATION = "xla"
    SYRK_SHAPES = [(64, 48), (3, 33, 17), (2, 2, 50, 20)]
    SYM_SIZES = [((), 40), ((3,), 24)]
    DTYPES = [jnp.float16, jnp.bfloat16, jnp.float32]

    def test_matches_float64_numpy(self):
        x = np.random.default_rng(0).standard_normal((2, 30, 50))
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
        pallas_kernels.sym_matmul(x, x, implementation="pallas")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU fallbacks")
def test_named_kernels_raise_on_cpu():
    x = jnp.ones((256, 256), jnp.float16)
    for impl in ("mosaic", "triton"):
        with pytest.raises(ValueError, match="cannot run on the default device"):
            pallas_kernels.syrk(x, implementation=impl)
        with pytest.raises(ValueError, match="cannot run on the default device"):
            pallas_kernels.sym_matmul(x, x, implementation=impl)


def test_triton_has_no_interpret_mode():
    x = jnp.ones((64, 64), jnp.float16)
    with pytest.raises(ValueError, match="no interpret mode"):
        pallas_kernels.syrk(x, implementation="triton", interpret=True)


@pytest.mark.parametrize("impl", ["mosaic", "triton"])
def test_kernels_reject_non_16_bit(impl):
    x = jnp.ones((64, 64), jnp.float32)
    with pytest.raises(ValueError, match="float16/bfloat16"):
        pallas_kernels.syrk(x, implementation=impl)


def test_auto_resolution(monkeypatch):
    f16 = (jnp.float16,)
    big = _api.AUTO_MIN_WORK
    assert _api._work((32, 1024, 4096)) == 32 * 1024 * 1024 * 4096
    assert _api._work((4096, 4096)) == big
    assert _api._resolve("xla", dtypes=f16, size=big, interpret=False) == "xla"
    monkeypatch.setattr(_api, "available_implementations", lambda: ("xla",))
    assert _api._resolve("auto", dtypes=f16, size=big, interpret=False) == "xla"
    monkeypatch.setattr(_api, "available_implementations", lambda: ("xla", "mosaic", "triton"))
    monkeypatch.setattr(_api, "_is_hopper", lambda device: True)
    assert _api._resolve("auto", dtypes=f16, size=big, interpret=False) == "mosaic"
    assert _api._resolve("auto", dtypes=f16, size=big - 1, interpret=False) == "xla"
    assert _api._resolve("auto", dtypes=(jnp.float32,), size=big, interpret=False) == "xla"
    monkeypatch.setattr(_api, "_is_hopper", lambda device: False)
    assert _api._resolve("auto", dtypes=f16, size=big, interpret=False) == "triton"


def test_shape_errors():
    a = jnp.ones((8, 4), jnp.float16)
    with pytest.raises(ValueError, match="need a"):
        pallas_kernels.sym_matmul(a, a)
    with pytest.raises(ValueError, match="c must be"):
        pallas_kernels.sym_matmul(a, a.T, jnp.ones((4, 4), jnp.float16))


def test_auto_on_cpu_is_the_reference_and_jits():
    x = jax.random.normal(jax.random.key(0), (3, 40, 24), jnp.bfloat16)
    out = jax.jit(pallas_kernels.syrk)(x)
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)),
                                  np.asarray(pallas_kernels.syrk_reference(x).astype(jnp.float32)))


# ----------------------------------------------------------------------------------------------
# The Mosaic GPU kernel through GPU interpret mode (jax 0.11.2 supports it; private import).


class TestMosaicInterpret(KernelSuite):
    IMPLEMENTATION = "mosaic"
    INTERPRET = True
    SYRK_SHAPES = [(64, 48), (128, 64), (200, 72), (2, 136, 80)]
    SYM_SIZES = [((), 64), ((), 200), ((2,), 130)]
    DTYPES = [jnp.float16, jnp.bfloat16]

    def test_every_element_written_and_no_races(self):
        """Interpret mode fills fresh buffers with NaN: a tile-aligned output shows every write."""
        from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

        from pallas_kernels._mosaic import MosaicConfig, sym_matmul_mosaic, syrk_mosaic

        params = InterpretGPUParams(detect_races=True, uninitialized_memory="nan")
        config = MosaicConfig(num_sms=3)  # Fewer CTAs than tiles: each CTA walks several.
        x = jax.random.normal(jax.random.key(3), (2, 384, 128), jnp.float16)
        out = np.asarray(syrk_mosaic(x, config=config, interpret=params), np.float32)
        assert not np.isnan(out).any()
        assert not interpret_pallas_call.get_races().races_found
        a, b, c, _ = commuting_inputs(jax.random.key(4), (), 256, jnp.bfloat16, 1.0, 1.0)
        out = sym_matmul_mosaic(a, b, c, alpha=0.5, beta=2.0, config=config, interpret=params)
        assert not np.isnan(np.asarray(out, np.float32)).any()
        assert not interpret_pallas_call.get_races().races_found

    def test_single_compute_warpgroup_config(self):
        from pallas_kernels._mosaic import MosaicConfig, syrk_mosaic

        x, ref = gram_inputs(jax.random.key(5), (130, 96), jnp.float16)
        config = MosaicConfig(num_compute_wgs=1, max_concurrent_steps=2)
        out = syrk_mosaic(x, config=config, interpret=True)
        assert rel_error(out, ref) <= 2.0 * xla_error_syrk(x, ref, jnp.float16) + 1e-6

    def test_config_validation(self):
        from pallas_kernels._mosaic import MosaicConfig

        with pytest.raises(ValueError, match="multiple of 64"):
            MosaicConfig(tile=96)
        with pytest.raises(ValueError, match="tile_k"):
            MosaicConfig(tile_k=8)

    # Optional MosaicConfig fields (main-loop variants measured by benchmarks/bench_kernels.py).
    VARIANTS = {
        "inflight1": dict(wgmma_in_flight=1),
        "pair": dict(pair_tiles=True),
        "pair_index": dict(pair_tiles=True, pair_select="index"),
        "pair_index_inflight1": dict(pair_tiles=True, pair_select="index", wgmma_in_flight=1),
        "pair_epi128_s3": dict(pair_tiles=True, epi_cols=128, max_concurrent_steps=3),
        "pair_index_inflight1_dbuf_s3": dict(pair_tiles=True, pair_select="index",
                                             wgmma_in_flight=1, epi_double_buffer=True,
                                             max_concurrent_steps=3),
        "pair_index_inflight1_diag": dict(pair_tiles=True, pair_select="index",
                                          wgmma_in_flight=1, diag_in_epilogue=True),
        "pair_index_inflight1_brows": dict(pair_tiles=True, pair_select="index",
                                           wgmma_in_flight=1, b_rows=True),
        "pair_index_inflight1_brows_diag": dict(pair_tiles=True, pair_select="index",
                                                wgmma_in_flight=1, b_rows=True,
                                                diag_in_epilogue=True),
    }

    @pytest.mark.parametrize("variant", sorted(VARIANTS))
    def test_variant(self, variant):
        """Each variant: every element written (NaN-poisoned buffers), no races, exact symmetry,
        error <= 2x XLA's against float64; tile grids with T = 2, 3, 5 (paired walk singles and all
        of its sections but the quads' neighbours) and a batch; contraction long enough that the
        pipeline ring wraps (k_iters > stages)."""
        from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

        from pallas_kernels._mosaic import MosaicConfig, sym_matmul_mosaic, syrk_mosaic

        config = MosaicConfig(num_sms=3, **self.VARIANTS[variant])
        params = InterpretGPUParams(detect_races=True, uninitialized_memory="nan")
        for s, (shape, dtype) in enumerate([((384, 640), jnp.float16), ((520, 200), jnp.bfloat16),
                                            ((2, 256, 320), jnp.float16)]):
            x, ref = gram_inputs(jax.random.key(300 + s), shape, dtype)
            out = np.asarray(syrk_mosaic(x, config=config, interpret=params), np.float32)
            assert not np.isnan(out).any(), (variant, shape)
            assert not interpret_pallas_call.get_races().races_found, (variant, shape)
            np.testing.assert_array_equal(out, np.swapaxes(out, -1, -2))
            err, xla_err = rel_error(out, ref), xla_error_syrk(x, ref, dtype)
            assert err <= 2.0 * xla_err + 1e-6, (variant, shape, err, xla_err)
        for s, (batch, n, alpha, beta) in enumerate([((), 384, 2.0, -0.5), ((2,), 256, 1.0, 0.0)]):
            a, b, c, ref = commuting_inputs(jax.random.key(400 + s), batch, n, jnp.bfloat16, alpha,
                                            beta)
            kw = dict(alpha=alpha, beta=beta)
            out = sym_matmul_mosaic(a, b, c, config=config, interpret=params, **kw)
            out = np.asarray(out, np.float32)
            assert not np.isnan(out).any(), (variant, n)
            assert not interpret_pallas_call.get_races().races_found, (variant, n)
            np.testing.assert_array_equal(out, np.swapaxes(out, -1, -2))
            xla = pallas_kernels.sym_matmul(a, b, c, implementation="xla", **kw)
            err, xla_err = rel_error(out, ref), rel_error(xla, ref)
            assert err <= 2.0 * xla_err + 1e-6, (variant, n, err, xla_err)

    def test_pair_variant_with_quads_and_interior_blocks(self):
        """T = 8: two diagonal 4×4-tile blocks (5 items each) and the blocks between them."""
        from pallas_kernels._mosaic import MosaicConfig, syrk_mosaic

        x, ref = gram_inputs(jax.random.key(9), (1000, 64), jnp.float16)
        for select in ("when", "index"):
            config = MosaicConfig(num_sms=5, pair_tiles=True, pair_select=select)
            out = np.asarray(syrk_mosaic(x, config=config, interpret=True), np.float32)
            np.testing.assert_array_equal(out, out.T)
            assert rel_error(out, ref) <= 2.0 * xla_error_syrk(x, ref, jnp.float16) + 1e-6

    def test_variant_config_validation(self):
        from pallas_kernels._mosaic import MosaicConfig

        with pytest.raises(ValueError, match="wgmma_in_flight"):
            MosaicConfig(wgmma_in_flight=2)
        with pytest.raises(ValueError, match="wgmma_in_flight"):
            MosaicConfig(wgmma_in_flight=1, max_concurrent_steps=1)
        with pytest.raises(ValueError, match="num_compute_wgs"):
            MosaicConfig(pair_tiles=True, num_compute_wgs=1)
        with pytest.raises(ValueError, match="epi_cols"):
            MosaicConfig(pair_tiles=True, epi_cols=96)
        with pytest.raises(ValueError, match="pair_select"):
            MosaicConfig(pair_tiles=True, pair_select="branch")
        with pytest.raises(ValueError, match="epi_double_buffer"):
            MosaicConfig(epi_double_buffer=True)
        with pytest.raises(ValueError, match="diag_in_epilogue needs"):
            MosaicConfig(diag_in_epilogue=True)
        with pytest.raises(ValueError, match="diag_in_epilogue needs"):
            MosaicConfig(pair_tiles=True, epi_cols=128, diag_in_epilogue=True)

    def test_default_config_fits_shared_memory(self):
        """The default is the tuned pair kernel; a float32 output gets a shallower pipeline."""
        from pallas_kernels._mosaic import SMEM_LIMIT, MosaicConfig, smem_bytes

        for in_dtype in (jnp.float16, jnp.bfloat16):
            for out_dtype, stages in ((in_dtype, 4), (jnp.float32, 3)):
                config = MosaicConfig.get_default(in_dtype, out_dtype)
                assert config.pair_tiles and config.wgmma_in_flight == 1
                assert config.max_concurrent_steps == stages, (in_dtype, out_dtype, config)
                assert smem_bytes(config, in_dtype, out_dtype) <= SMEM_LIMIT
                deeper = dataclasses.replace(config, max_concurrent_steps=stages + 1)
                assert smem_bytes(deeper, in_dtype, out_dtype) > SMEM_LIMIT

    def test_default_overrides_apply_inside_the_context_only(self):
        """The benchmarks' private switch sets default fields at trace time, then restores them."""
        from pallas_kernels._mosaic import MosaicConfig, _default_overrides

        with _default_overrides(diag_in_epilogue=True):
            inside = MosaicConfig.get_default(jnp.float16, jnp.float32)
        assert inside.diag_in_epilogue and inside.max_concurrent_steps == 3
        assert not MosaicConfig.get_default().diag_in_epilogue

    def test_b_rows_needs_a_square_b(self):
        from pallas_kernels._mosaic import MosaicConfig, sym_matmul_mosaic

        config = MosaicConfig(pair_tiles=True, b_rows=True)
        a, b = jnp.ones((128, 64), jnp.float16), jnp.ones((64, 128), jnp.float16)
        with pytest.raises(ValueError, match="b_rows"):
            sym_matmul_mosaic(a, b, config=config, interpret=True)

    def test_config_over_shared_memory_raises(self):
        """An explicit configuration that cannot fit says so before anything is launched (the
        H200 rejected the old default for float32 outputs: 262208 > 232448 bytes)."""
        from pallas_kernels._mosaic import MosaicConfig, syrk_mosaic

        x = jnp.ones((128, 64), jnp.float16)
        with pytest.raises(ValueError, match="shared memory"):
            syrk_mosaic(x, out_dtype=jnp.float32, config=MosaicConfig(), interpret=True)
        out = syrk_mosaic(x, out_dtype=jnp.float32, interpret=True)  # The default fits.
        np.testing.assert_allclose(np.asarray(out), 64.0)

    @pytest.mark.parametrize("variant", ["default", "default_f32_out", *sorted(VARIANTS)])
    def test_lowers_for_sm90_at_headline_shapes(self, variant):
        """The Mosaic GPU lowering (layout inference, shared-memory budget) succeeds for sm_90 on
        CPU at the benchmark's headline shapes; ptxas is not run."""
        from pallas_kernels._mosaic import MosaicConfig, sym_matmul_mosaic, syrk_mosaic

        if variant.startswith("default"):
            out = jnp.float32 if variant.endswith("f32_out") else jnp.float16
            config = MosaicConfig.get_default(jnp.float16, out)
        else:
            out, config = jnp.float16, MosaicConfig(**self.VARIANTS[variant])
        config = dataclasses.replace(config, num_sms=132)
        f16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float16)
        jax.jit(lambda x: syrk_mosaic(x, out_dtype=out, config=config)).trace(
            f16(4096, 16384)).lower(lowering_platforms=("cuda",))
        jax.jit(lambda a, b, c: sym_matmul_mosaic(a, b, c, alpha=1.0, beta=0.5, out_dtype=out,
                                                  config=config)).trace(
            f16(4096, 4096), f16(4096, 4096), f16(4096, 4096)).lower(lowering_platforms=("cuda",))
