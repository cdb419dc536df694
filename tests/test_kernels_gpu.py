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
"""The compiled kernels on a GPU: the shared accuracy suite on many shapes, every output element
written, symmetry (exact for ``syrk``; for ``sym_matmul`` exact mirrors across tiles). Skipped where
the backend is not available (CPU CI)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
import test_kernels as base

SEED = base.SEED  # the suite's inputs come from test_kernels' seed (printed by conftest)
_AVAILABLE = pallas_kernels.available_implementations()

_GPU_SYRK_SHAPES = [(64, 48), (128, 64), (200, 72), (1000, 3000), (4, 300, 500),
                    (32, 1024, 4096)]
_GPU_SYM_SIZES = [((), 128), ((), 200), ((), 1000), ((3,), 300)]


def _poisoned_call(fn, shape, dtype):
    """Runs ``fn()`` after freeing a NaN-filled buffer of the output's size.

    Returns ``(out, reused)``: ``reused`` says whether the output landed in the poisoned buffer, in
    which case a NaN-free output proves that every element was written.
    """
    poison = jnp.full(shape, jnp.nan, dtype).block_until_ready()
    address = poison.unsafe_buffer_pointer()
    poison.delete()
    out = jax.block_until_ready(fn())
    return out, out.unsafe_buffer_pointer() == address


class GpuSuite(base.KernelSuite):
    SYRK_SHAPES = _GPU_SYRK_SHAPES
    SYM_SIZES = _GPU_SYM_SIZES

    def test_large_shapes(self):
        """4096×16384 and 8192×28672 syrk, 4096² sym_matmul (float16; bfloat16 is covered above)."""
        for shape in [(4096, 16384), (8192, 28672)]:
            x, ref = base.gram_inputs(base.fresh_key(11), shape, jnp.float16)
            out = self.syrk(x)
            o = np.asarray(out.astype(jnp.float32))
            np.testing.assert_array_equal(o, o.T)
            err, xla_err = base.rel_error(out, ref), base.xla_error_syrk(x, ref, jnp.float16)
            assert err <= self.ERROR_FACTOR * xla_err, (shape, err, xla_err)
            del x, ref, out, o
        a, b, c, ref = base.commuting_inputs(base.fresh_key(12), (), 4096, jnp.float16, 1.0, 3.9)
        out = self.sym_matmul(a, b, c, alpha=1.0, beta=3.9)
        base.assert_tiles_mirrored(out, jnp.float16, diagonal_exact=self.SYM_DIAGONAL_EXACT)
        xla = pallas_kernels.sym_matmul(a, b, c, alpha=1.0, beta=3.9, implementation="xla")
        assert base.rel_error(out, ref) <= self.ERROR_FACTOR * base.rel_error(xla, ref)

    def test_scales_share_one_kernel(self):
        """Products of one shape with different ``α, β`` lower to one kernel (the scales are
        run-time operands) and each matches the jnp reference to its error."""
        a, b, c, _ = base.commuting_inputs(base.fresh_key(13), (), 384, jnp.float16, 1.0, 1.0)
        scales = [(2.0, 0.5), (1.0, -3.0), (-0.25, 1.5)]
        fn = jax.jit(lambda a, b, c: [self.sym_matmul(a, b, c, alpha=al, beta=be)
                                      for al, be in scales])
        text = fn.trace(a, b, c).lower().as_text()
        target = {"mosaic": "custom_call @mosaic_gpu",
                  "jax_triton": "custom_call @triton_kernel_call"}[self.IMPLEMENTATION]
        assert text.count(target) == 1, text.count(target)
        for out, (al, be) in zip(fn(a, b, c), scales):
            _, _, _, ref = base.commuting_inputs(base.fresh_key(13), (), 384, jnp.float16, al, be)
            xla = pallas_kernels.sym_matmul(a, b, c, alpha=al, beta=be, implementation="xla")
            assert base.rel_error(out, ref) <= self.ERROR_FACTOR * base.rel_error(xla, ref) + 1e-6

    def test_every_element_written(self):
        reused_any = False
        for shape in [(128, 64), (3, 256, 192), (4096, 2048)]:
            x = jax.random.normal(base.fresh_key(1), shape, jnp.float16)
            out_shape = shape[:-1] + shape[-2:-1]
            fn = jax.jit(lambda: self.syrk(x))
            jax.block_until_ready(fn())  # Compile first, so the poisoned buffer is the last freed.
            out, reused = _poisoned_call(fn, out_shape, jnp.float16)
            assert np.isfinite(np.asarray(out, np.float32)).all(), shape
            reused_any |= reused
        for n in (128, 4096):
            a, b, c, _ = base.commuting_inputs(base.fresh_key(2), (), n, jnp.float16, 1.0, 1.0)
            fn = jax.jit(lambda: self.sym_matmul(a, b, c, alpha=2.0, beta=0.5))
            jax.block_until_ready(fn())
            out, reused = _poisoned_call(fn, (n, n), jnp.float16)
            assert np.isfinite(np.asarray(out, np.float32)).all(), n
            reused_any |= reused
        print(f"{self.IMPLEMENTATION}: output reused a poisoned buffer: {reused_any}")


@pytest.mark.gpu
@pytest.mark.skipif("mosaic" not in _AVAILABLE, reason="needs a Hopper GPU")
class TestMosaicGpu(GpuSuite):
    IMPLEMENTATION = "mosaic"
    SYM_DIAGONAL_EXACT = False

    def test_one_contraction_step_with_several_items_per_cta(self):
        """k <= tile_k (one pipeline stage, slots released at once) with one CTA walking every
        item and with the default grid: exact symmetry, accuracy as XLA's."""
        from pallas_kernels._mosaic import MosaicConfig, syrk_mosaic

        for config in (MosaicConfig(num_sms=1), None):
            for shape in [(384, 64), (64, 512, 40)]:
                x, ref = base.gram_inputs(base.fresh_key(13), shape, jnp.float16)
                out = np.asarray(syrk_mosaic(x, config=config), np.float32)
                np.testing.assert_array_equal(out, np.swapaxes(out, -1, -2))
                err, xla_err = base.rel_error(out, ref), base.xla_error_syrk(x, ref, jnp.float16)
                assert err <= self.ERROR_FACTOR * xla_err, (shape, config, err, xla_err)


@pytest.mark.gpu
@pytest.mark.skipif("jax_triton" not in _AVAILABLE, reason="needs an NVIDIA GPU and jax-triton")
class TestTritonGpu(GpuSuite):
    IMPLEMENTATION = "jax_triton"


def gram_ns_errors(impl: str, shape, seed: int = 0):
    """``(err_impl, err_xla, diff)``: Gram NS (float16) with ``impl`` and with XLA against the same
    iteration in float64 (standard NS, same coefficients), and their relative difference."""
    from dion3_jax import polar

    x = jax.random.normal(jax.random.key(seed), shape, jnp.float32)
    with jax.enable_x64(True):
        ref = np.asarray(polar(x.astype(jnp.float64), method="standard",
                               compute_dtype=jnp.float64, backend="xla"))
    out = np.asarray(polar(x, method="gram", backend=impl), np.float64)
    xla = np.asarray(polar(x, method="gram", backend="xla"), np.float64)
    rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))
    return rel(out, ref), rel(xla, ref), rel(out, xla)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", [i for i in ("mosaic", "jax_triton") if i in _AVAILABLE] or
                         [pytest.param("mosaic", marks=pytest.mark.skip(reason="needs a GPU"))])
@pytest.mark.parametrize("shape", [(1024, 4096), (3, 512, 1536), (4096, 1024)])
def test_gram_ns_with_kernels_agrees_with_xla(impl, shape):
    """Gram NS through the kernels agrees with XLA's Gram NS at float16 tolerance (H200, 4096×16384:
    2.5e-3), and is no less accurate against a float64 run of the same iteration."""
    err, xla_err, diff = gram_ns_errors(impl, shape)
    assert diff <= 1e-2, (impl, shape, diff)
    assert err <= 1.5 * xla_err + 1e-3, (impl, shape, err, xla_err)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(4096, 4096, 11008), (8, 1024, 1024, 4096)])
def test_16bit_gemm_output_accumulates_in_float32(shape, dtype):
    """Gram NS's ``Q·X`` asks XLA for a 16-bit result (``preferred_element_type`` = the operands'
    dtype): it must be float32 accumulation rounded once, i.e. as close to a float64 product as
    the float32-result GEMM rounded to 16 bits, and almost everywhere bitwise equal to it (GEMM
    algorithms may differ in summation order). Accumulating in 16 bits would be far worse."""
    from dion3_jax import _polar

    *batch, n, k, m = shape
    kq, kx = jax.random.split(jax.random.key(SEED))
    q = (jax.random.normal(kq, (*batch, n, k), jnp.float32) / np.sqrt(k)).astype(dtype)
    x = jax.random.normal(kx, (*batch, k, m), jnp.float32).astype(dtype)
    out = jax.jit(_polar._matmul)(q, x)
    f32 = jax.jit(lambda a, b: jnp.einsum("...ik,...kj->...ij", a, b,
                                          preferred_element_type=jnp.float32).astype(dtype))(q, x)
    assert out.dtype == dtype
    ref = np.matmul(np.asarray(q, np.float64), np.asarray(x, np.float64))
    err = lambda o: float(np.linalg.norm(np.asarray(o, np.float64) - ref) / np.linalg.norm(ref))
    same = float(np.mean(np.asarray(out, np.float32) == np.asarray(f32, np.float32)))
    print(f"{shape} {jnp.dtype(dtype).name}: rel.err 16-bit result {err(out):.3e}, float32 "
          f"result rounded {err(f32):.3e}, bitwise equal {same:.4%}")
    assert err(out) <= 1.05 * err(f32), (err(out), err(f32))
    assert same >= 0.99, same


def _payload_inputs(rng, batches, shape):
    """Random float32 sums per member, and norms in [100, 900] per matrix of the stack."""
    keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), len(batches) + 1)
    sums = [jax.random.normal(keys[i], (b, *shape)) for i, b in enumerate(batches)]
    ds = jax.random.uniform(keys[-1], (sum(batches),), minval=100.0, maxval=900.0)
    return sums, ds


def _check_against_xla(run, impl="pallas_triton"):
    """``run(implementation)`` with ``impl`` against "xla": payloads finite and within one
    float16 rounding. Returns the share of payload entries bitwise equal and the kernel's stack
    (float32)."""
    g, w = np.asarray(run(impl), np.float32), np.asarray(run("xla"), np.float32)
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, w, rtol=2.0 ** -10, atol=2.0 ** -24)
    return float(np.mean(g == w)), g


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("batches,rows,cols", [([1, 1, 1], 4096, 11008), ([2, 3], 256, 96),
                                               ([1, 1], 11008, 4096)])
def test_payload_kernel_agrees_with_xla(batches, rows, cols):
    """``stack_payloads`` through the Pallas kernel against the XLA reference on the GPU: the
    float16 payloads within one float16 rounding (the kernel's division may round the float32
    quotient differently), and every slot of the stack written."""
    sums, ds = _payload_inputs(np.random.default_rng(SEED), batches, (rows, cols))
    run = lambda impl: jax.jit(lambda *a: pallas_kernels.stack_payloads(  # noqa: E731
        *a, out_dtype=jnp.float16, implementation=impl))(sums, ds)
    g, _ = _check_against_xla(run)
    print(f"{batches} {rows}x{cols}: payload bitwise equal {g:.5%}")


@pytest.mark.gpu
@pytest.mark.skipif("mosaic" not in _AVAILABLE, reason="needs a Hopper GPU")
@pytest.mark.parametrize("batches,rows,cols", [([1, 1, 1], 4096, 11008), ([2, 3], 256, 96),
                                               ([1, 1], 11008, 4096)])
def test_mosaic_payload_kernel_agrees_with_xla(batches, rows, cols):
    """``stack_payloads`` without rows through the Mosaic GPU kernel against the XLA reference
    on the GPU, as the Pallas-Triton kernel above."""
    sums, ds = _payload_inputs(np.random.default_rng(SEED), batches, (rows, cols))
    run = lambda impl: jax.jit(lambda *a: pallas_kernels.stack_payloads(  # noqa: E731
        *a, out_dtype=jnp.float16, implementation=impl))(sums, ds)
    g, _ = _check_against_xla(run, "mosaic")
    print(f"{batches} {rows}x{cols}: payload bitwise equal {g:.5%}")


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("row_axis,batches,shape", [(2, [1, 1, 1], (4096, 5504)),
                                                    (1, [2, 1], (11008, 2048)),
                                                    (2, [1, 2], (256, 96))])
def test_selected_rows_payload_kernel_agrees_with_xla(row_axis, batches, shape):
    """``stack_payloads`` with selected rows (a quarter, the first matrix's last two padding)
    through the Pallas kernel against the XLA reference on the GPU: the float16 payloads within
    one float16 rounding, padding rows zero."""
    rng = np.random.default_rng(SEED)
    sums, ds = _payload_inputs(rng, batches, shape)
    n = shape[row_axis - 1]
    rows = np.stack([np.sort(rng.choice(n, n // 4, replace=False))
                     for _ in range(sum(batches))])
    rows[0, -2:] = [n, n + 1]
    rows = jnp.asarray(rows, jnp.int32)
    run = lambda impl: jax.jit(lambda *a: pallas_kernels.stack_payloads(  # noqa: E731
        *a[:2], rows=a[2], row_axis=row_axis, out_dtype=jnp.float16, implementation=impl))(
        sums, ds, rows)
    same, stack = _check_against_xla(run)
    assert not np.any(np.take(stack[0], [-2, -1], axis=row_axis - 1))
    print(f"{batches} {shape} rows on axis {row_axis}: payload bitwise equal {same:.5%}")


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("impl,row_axis,shape,dtype", [
    *[(impl, *case) for impl in ("pallas_triton", "mosaic")
      for case in ((2, (2, 4096, 11008), jnp.float32), (1, (2, 11008, 4096), jnp.float32),
                   (2, (2, 11008, 4096), jnp.float32), (1, (2, 4096, 11008), jnp.float32),
                   (2, (3, 256, 96), jnp.bfloat16))],
    ("pallas_triton", 1, (3, 40, 48), jnp.float32), ("mosaic", 1, (3, 64, 48), jnp.bfloat16)])
def test_statistics_kernel_agrees_with_float64(impl, row_axis, shape, dtype):
    """``accumulate_rows`` through each kernel on the GPU, its momentum donated (written in
    place): ``S`` within one rounding of the XLA reference's, the row sums within float32
    summation error of a float64 computation of that ``S`` (fresh inputs, bfloat16 gradients)."""
    if impl not in _AVAILABLE:
        pytest.skip(f"{impl} does not run here")
    rng = np.random.default_rng(SEED)
    m = jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)
    g = jnp.asarray(rng.standard_normal(shape, np.float32)).astype(jnp.bfloat16)
    d = jnp.asarray(rng.choice([0.8, 1.0], (shape[0], shape[row_axis])).astype(np.float32))
    want = jax.jit(lambda *a: pallas_kernels.accumulate_rows_reference(*a, row_axis=row_axis))(
        m, g, d)
    s, l1, sq = jax.jit(lambda *a: pallas_kernels.accumulate_rows(
        *a, row_axis=row_axis, implementation=impl), donate_argnums=0)(m + 0, g, d)
    # S within one rounding of the reference's (either may contract d·M + G into an FMA).
    dm = np.expand_dims(np.asarray(d, np.float64), 3 - row_axis) * np.asarray(m, np.float64)
    bound = (2.0 ** -23 + float(jnp.finfo(dtype).eps)) * (abs(dm) + abs(np.asarray(g, np.float64)))
    assert np.all(abs(np.asarray(s, np.float64) - np.asarray(want[0], np.float64)) <= bound)
    x = np.asarray(s, np.float64)
    axis = 3 - row_axis
    count = shape[axis]
    l1_64, sq_64 = np.abs(x).sum(axis), (x * 2.0 ** -32) ** 2
    np.testing.assert_allclose(np.asarray(l1), l1_64, rtol=count * 2.0 ** -24)
    np.testing.assert_allclose(np.asarray(sq), sq_64.sum(axis), rtol=count * 2.0 ** -23)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("impl", ["mosaic", "pallas_triton"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("row_axis,shape", [(2, (2, 4096, 11008)), (1, (2, 11008, 4096)),
                                            (2, (3, 256, 96)), (1, (3, 64, 48))])
def test_stochastic_statistics_kernel_is_xlas_bit_for_bit(impl, dtype, row_axis, shape):
    """A 16-bit momentum through each kernel, rounded stochastically with bits it hashes
    itself from a counter (random key and rows' words, wrapping steps), its momentum donated
    (a float16 one with its gradients scaled by ``2⁷``, as a float16 momentum's storage scale
    does): ``S`` is the XLA form's bit for bit, the row sums within float32 summation error."""
    from pallas_kernels._counter import RowCounter

    if impl not in _AVAILABLE:
        pytest.skip(f"{impl} does not run here")
    rng = np.random.default_rng(SEED)
    def words(*s):
        return jnp.asarray(rng.integers(0, 2 ** 32, s, np.uint64).astype(np.uint32))

    m = jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)
    g = jnp.asarray(rng.standard_normal(shape, np.float32) / 64)
    d = jnp.asarray(rng.choice([0.8145, 1.0], (shape[0], shape[row_axis])).astype(np.float32))
    counter = RowCounter(words(2), words(shape[0], 2, shape[row_axis]), (0x9E3779B9, 1))
    out_scale = jnp.float32(2.0 ** 7) if dtype == jnp.float16 else None
    want = jax.jit(lambda *a: pallas_kernels.accumulate_rows(
        *a, row_axis=row_axis, implementation="xla", counter=counter,
        out_scale=out_scale))(m, g, d)
    s, l1, sq = jax.jit(lambda *a: pallas_kernels.accumulate_rows(
        *a, row_axis=row_axis, implementation=impl, counter=counter, out_scale=out_scale),
        donate_argnums=0)(m + 0, g, d)
    np.testing.assert_array_equal(np.asarray(s).view(np.uint16),
                                  np.asarray(want[0]).view(np.uint16))
    x, axis = np.asarray(s, np.float64), 3 - row_axis
    np.testing.assert_allclose(np.asarray(l1), np.abs(x).sum(axis), rtol=shape[axis] * 2.0 ** -24)
    np.testing.assert_allclose(np.asarray(sq), ((x * 2.0 ** -32) ** 2).sum(axis),
                               rtol=shape[axis] * 2.0 ** -23)


@pytest.mark.gpu
@pytest.mark.skipif("mosaic" not in _AVAILABLE, reason="needs a Hopper GPU")
@pytest.mark.parametrize("fraction", [1.0, 0.25])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_step_with_16bit_momentum_through_mosaic_is_xlas_bit_for_bit(dtype, fraction):
    """Three steps of ``scale_by_dion3`` with a 16-bit momentum (stacked, transposed and plain
    matrices; a float16 one stored with its scale): the statistics pass through the Mosaic
    kernel leaves the momentum and its row factors of the all-XLA step bit for bit (the row
    sums, added in another order, select the same rows)."""
    import dion3_jax

    rng = np.random.default_rng(SEED)
    shapes = {"up": (512, 1408), "down": (1408, 512), "qkv": (2, 512, 768)}
    grads = [{k: jnp.asarray(rng.standard_normal(s, np.float32)) for k, s in shapes.items()}
             for _ in range(3)]
    polar = dion3_jax.make_orthogonalizer(backend="xla")   # (the momentum does not read it)

    def run(impl):
        tx = dion3_jax.scale_by_dion3(fraction, 0.9, mu_dtype=dtype, pass_implementation=impl,
                                      orthogonalizer=polar)
        state = tx.init(jax.tree.map(jnp.zeros_like, grads[0]))
        for g in grads:
            _, state = jax.jit(tx.update)(g, state)
        return state.momentum, state.momentum_scale

    (got, got_d), (want, want_d) = run("mosaic"), run("xla")
    for k in shapes:
        assert got[k].dtype == dtype
        np.testing.assert_array_equal(np.asarray(got[k]).view(np.uint16),
                                      np.asarray(want[k]).view(np.uint16))
        np.testing.assert_array_equal(np.asarray(got_d[k]), np.asarray(want_d[k]))


@pytest.mark.gpu
@pytest.mark.skipif("mosaic" not in _AVAILABLE, reason="needs a Hopper GPU")
@pytest.mark.parametrize("mu_dtype", [jnp.float32, jnp.float16])
def test_default_step_is_bitwise_reproducible(mu_dtype):
    """The default ``dion3`` step with its kernels, run twice from the same state on the same
    gradients (three steps each, one compiled executable), must give the same updates and state
    bit for bit: a 16-bit momentum's stochastic rounding is keyed by the step and the leaf, and
    no pass may add in a run-dependent order (atomics), so that an optimizer's part of a
    training run is reproducible on a GPU (docs/QUALITY.md measured whole runs that were not)."""
    import dion3_jax

    rng = np.random.default_rng(SEED)
    shapes = {"up": (512, 1408), "down": (1408, 512), "o": (512, 512), "b": (512,)}
    params = {k: jnp.asarray(rng.standard_normal(s, np.float32)) for k, s in shapes.items()}
    grads = [{k: jnp.asarray(rng.standard_normal(s, np.float32)) for k, s in shapes.items()}
             for _ in range(3)]
    tx = dion3_jax.dion3(0.02, fraction=0.25, mu_dtype=mu_dtype)
    update = jax.jit(tx.update)

    def run():
        state, outs = tx.init(params), []
        for g in grads:
            u, state = update(g, state, params)
            outs.append(u)
        return jax.device_get((outs, state))

    first, second = run(), run()
    leaves = zip(jax.tree.leaves_with_path(first), jax.tree.leaves(second))
    for (path, a), b in leaves:
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), jax.tree_util.keystr(path)
