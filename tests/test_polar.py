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
"""polar(): Gram vs standard Newton-Schulz, presets, shapes, dtypes, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dion3_jax
from dion3_jax import _polar, newton_schulz, polar
from dion3_jax._polar_operator import BuiltinPolar
import dion3_reference as ref
from seeds import module_seed


#: Every run draws fresh inputs (``_rand``'s ``seed`` is an offset from ``SEED``, printed with
#: each test by ``conftest.print_module_seed``).
SEED = module_seed()


def _rand(shape, seed):
    return np.random.default_rng(SEED + seed).standard_normal(shape)


@pytest.mark.parametrize("shape", [(32, 96), (96, 32), (3, 16, 80), (2, 2, 24, 40)])
@pytest.mark.parametrize("restarts", [(), (2,), (1, 3)])
def test_gram_equals_standard_in_float64(shape, restarts):
    x = _rand(shape, 0)
    with jax.enable_x64(True):
        g = polar(jnp.asarray(x), method="gram", restarts=restarts, compute_dtype=jnp.float64)
        s = polar(jnp.asarray(x), method="standard", compute_dtype=jnp.float64)
        assert g.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(g), np.asarray(s), rtol=0, atol=1e-12)


def test_matches_numpy_newton_schulz_float64():
    x = _rand((40, 72), 1)
    with jax.enable_x64(True):
        got = np.asarray(polar(jnp.asarray(x), compute_dtype=jnp.float64))
    np.testing.assert_allclose(got, ref.ns_polar(x), rtol=0, atol=1e-12)


@pytest.mark.parametrize("shape", [(64, 256), (256, 64),
                                   pytest.param((4, 48, 160), marks=pytest.mark.slow)])
def test_float16_gram_agrees_with_float64(shape):
    x = _rand(shape, 2)
    with jax.enable_x64(True):
        want = np.asarray(polar(jnp.asarray(x), method="standard", compute_dtype=jnp.float64))
    for method in ("gram", "standard"):
        got = np.asarray(polar(jnp.asarray(x, jnp.float32), method=method))
        err = np.abs(got - want).max()
        assert err < 2e-2, (method, err)


@pytest.mark.parametrize("coefficients", ["polar_express", "you", "jordan"])
def test_singular_values_in_band(coefficients):
    x = _rand((3, 64, 192), 3)
    o = np.asarray(polar(jnp.asarray(x, jnp.float32), coefficients=coefficients))
    sv = np.linalg.svd(o, compute_uv=False)
    lo, hi = {"polar_express": (0.7, 1.25), "you": (0.6, 1.25), "jordan": (0.55, 1.3)}[coefficients]
    assert sv.min() > lo and sv.max() < hi, (sv.min(), sv.max())


def test_more_steps_converge_to_orthogonal():
    x = _rand((48, 128), 4)
    with jax.enable_x64(True):
        # (2, -1.5, 0.5): p(1) = 1 and p'(1) = 0, so the iteration converges to the polar factor.
        o = np.asarray(polar(jnp.asarray(x), coefficients=[(2.0, -1.5, 0.5)] * 40,
                             restarts=(2, 10, 20, 30), compute_dtype=jnp.float64))
    np.testing.assert_allclose(o @ o.T, np.eye(48), atol=1e-6)
    u, _, vt = np.linalg.svd(x, full_matrices=False)
    np.testing.assert_allclose(o, u @ vt, atol=1e-6)


def test_user_coefficients_and_square_fallback():
    x = _rand((32, 32), 5)
    coeffs = [(3.4445, -4.7750, 2.0315)] * 6
    with jax.enable_x64(True):
        g = polar(jnp.asarray(x), coefficients=coeffs, method="gram", compute_dtype=jnp.float64)
        s = polar(jnp.asarray(x), coefficients=coeffs, method="standard",
                  compute_dtype=jnp.float64)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(s))  # square → standard NS exactly
    np.testing.assert_allclose(np.asarray(g), ref.ns_polar(x, coeffs), atol=1e-12)


# The wide twins of the tall cases (64 × 80, 72 × 96) run with the slow tests: the crossover
# reads max(n, m) / min(n, m), whatever the orientation, and both orientations of Gram NS are
# checked in the fast loop by test_transposition_consistent.
@pytest.mark.parametrize("shape,gram", [
    ((80, 64), False), pytest.param((64, 80), False, marks=pytest.mark.slow), ((96, 72), True),
    pytest.param((72, 96), True, marks=pytest.mark.slow), ((2, 96, 64), True)])
def test_near_square_inputs_take_standard_newton_schulz(shape, gram):
    """``method="gram"`` runs Gram Newton-Schulz from aspect 4/3 (the measured crossover) and
    standard Newton-Schulz below it: at aspect 1.25 its float16 result is bitwise standard NS's,
    from 4/3 on it is Gram NS's (``newton_schulz.gram_newton_schulz`` on the same normalized
    input), which differs from standard NS's in float16."""
    x = jnp.asarray(_rand(shape, 11))
    got = np.asarray(polar(x, method="gram", compute_dtype=jnp.float16, out_dtype=jnp.float32))
    std = np.asarray(polar(x, method="standard", compute_dtype=jnp.float16,
                           out_dtype=jnp.float32))
    y = _polar._normalized(x.reshape((-1, *shape[-2:])), 1e-7, jnp.float16).reshape(shape)
    coeffs = newton_schulz.get_coefficients("polar_express")
    gram_ns = np.asarray(newton_schulz.gram_newton_schulz(y, coeffs, (2,)), np.float32)
    if gram:
        np.testing.assert_array_equal(got, gram_ns)
        assert not np.array_equal(got, std)
    else:
        np.testing.assert_array_equal(got, std)
        assert not np.array_equal(got, gram_ns)


@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow),
                                   jnp.float16])
def test_dtype_preserved_jit_vmap(dtype):
    x = jnp.asarray(_rand((5, 16, 48), 6), dtype)
    o = jax.jit(polar)(x)
    assert o.dtype == dtype and o.shape == x.shape
    ov = jax.vmap(polar)(x)
    np.testing.assert_allclose(np.asarray(ov, np.float32), np.asarray(o, np.float32), atol=2e-2)


def test_transposition_consistent():
    x = _rand((24, 64), 7)
    with jax.enable_x64(True):
        a = np.asarray(polar(jnp.asarray(x), compute_dtype=jnp.float64))
        b = np.asarray(polar(jnp.asarray(x.T), compute_dtype=jnp.float64))
    np.testing.assert_allclose(a, b.T, atol=1e-13)


def test_zero_matrix_stays_finite():
    o = polar(jnp.zeros((2, 8, 16)))
    assert bool(jnp.all(o == 0))


@pytest.mark.parametrize("kwargs,match", [
    ({"method": "svd"}, "method"),
    ({"backend": "gpu"}, "backend"),
    ({"restarts": (0,)}, "restarts"),
    ({"restarts": 2}, "restarts"),
    ({"coefficients": "unknown"}, "coefficients"),
    ({"steps": 0}, "steps"),
    ({"eps": 0.0}, "eps"),
    ({"compute_dtype": jnp.int8}, "compute_dtype"),
    ({"out_dtype": jnp.int32}, "out_dtype"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        polar(jnp.ones((4, 8)), **kwargs)


def test_bad_inputs():
    with pytest.raises(ValueError, match="at least 2"):
        polar(jnp.ones((4,)))
    with pytest.raises(ValueError, match="floating"):
        polar(jnp.ones((4, 4), jnp.int32))


def test_coefficient_presets():
    pe = newton_schulz.get_coefficients("polar_express")
    np.testing.assert_allclose(pe[0], (8.28721201814563 / 1.05, -23.595886519098837 / 1.05**3,
                                       17.300387312530933 / 1.05**5))
    assert len(newton_schulz.get_coefficients("jordan")) == 5
    assert len(newton_schulz.get_coefficients("you", steps=7)) == 7
    assert (newton_schulz.get_coefficients("you", steps=2)
            == newton_schulz.COEFFICIENT_PRESETS["you"][:2])


@pytest.mark.parametrize("method,shape", [("gram", (2, 100, 300)), ("gram", (1, 120, 125)),
                                          ("gram", (2, 300, 100)), ("gram", (1, 125, 120)),
                                          ("standard", (1, 130, 130)), ("standard", (1, 200, 70)),
                                          ("gram", (3, 64, 64))])
def test_padding_to_kernel_tiles_is_exact(method, shape):
    """Zero-padding the batch once to the kernels' tile multiples (what polar does when a kernel
    runs) gives the unpadded result, here on the XLA path in float64, where only the summation
    order of the padded contractions can differ (fresh random inputs)."""
    from dion3_jax import _polar
    from dion3_jax._coefficients import get_coefficients

    with jax.enable_x64(True):
        x = np.random.default_rng(SEED).standard_normal(shape)
        x = jnp.asarray(x / np.linalg.norm(x, axis=(-2, -1), keepdims=True), jnp.float64)
        coeffs = get_coefficients("polar_express")
        plain = _polar._iterate(x, coeffs, method, (2,), "xla", None)
        padded = _polar._iterate(x, coeffs, method, (2,), "xla", (128, 64))
        assert padded.shape == x.shape and padded.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(padded), np.asarray(plain), rtol=0, atol=1e-12)


def test_padding_multiples_follow_the_backend(monkeypatch):
    import pallas_kernels
    from pallas_kernels import _dispatch
    from pallas_kernels._mosaic import MosaicConfig
    from pallas_kernels._triton import TritonConfig

    assert pallas_kernels.padding_multiples((4096, 16384), jnp.float16, "xla") is None
    monkeypatch.setattr(_dispatch, "available_implementations", lambda: ("xla", "mosaic"))
    monkeypatch.setattr(_dispatch, "is_hopper", lambda device: True)
    assert pallas_kernels.padding_multiples((4096, 16384), jnp.float16) == (128, 64)
    assert pallas_kernels.padding_multiples((100, 300), jnp.float16) is None  # small: XLA
    assert pallas_kernels.padding_multiples((4096, 16384), jnp.float32) is None
    for config in (MosaicConfig.get_default(), TritonConfig.get_default()):
        assert (config.tile, config.tile_k) == pallas_kernels.TILE_MULTIPLES


@pytest.mark.slow
@pytest.mark.parametrize("method", ["gram", "standard"])
def test_stacked_parts_equal_polar_of_the_concatenation(method):
    """The built-in operator's ``stacked(parts)`` normalizes each part before stacking; the result
    is ``polar(concatenate(parts))``: float64 to 1e-12, the float16 default to fp16 tolerance.
    (Wide parts: a tall batch is normalized and stacked alike, and both sides then take the same
    tall iteration, tested above.)"""
    shape = (24, 64)
    rng = np.random.default_rng(SEED)
    parts = [jnp.asarray((rng.standard_normal((b, *shape)) * s).astype(np.float32))
             for b, s in zip((1, 3, 2), (1e-3, 1.0, 40.0))]
    with jax.enable_x64(True):
        p64 = [p.astype(jnp.float64) for p in parts]
        f = BuiltinPolar(dion3_jax.make_orthogonalizer(method=method, compute_dtype=jnp.float64,
                                                       backend="xla"))
        got, want = f.stacked(p64), polar(jnp.concatenate(p64), method=method,
                                           compute_dtype=jnp.float64, backend="xla")
        assert got.shape == (6, *shape) and got.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-12)
    f = jax.jit(BuiltinPolar(dion3_jax.make_orthogonalizer(method=method, backend="xla")).stacked)
    got, want = np.asarray(f(parts)), np.asarray(polar(jnp.concatenate(parts), method=method,
                                                       backend="xla"))
    assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want)


def test_stacked_parts_must_match():
    f = BuiltinPolar(dion3_jax.make_orthogonalizer(backend="xla"))
    with pytest.raises(ValueError, match="share their matrix shape"):
        f.stacked([jnp.ones((1, 4, 8)), jnp.ones((1, 4, 9))])
    with pytest.raises(ValueError, match="share their matrix shape"):
        f.stacked([jnp.ones((1, 4, 8)), jnp.ones((1, 4, 8), jnp.bfloat16)])
    with pytest.raises(ValueError, match="one entry per part"):
        f.stacked([jnp.ones((1, 4, 8)), jnp.ones((2, 4, 8))], [None])
    with pytest.raises(ValueError, match=r"norms of shape \(2,\)"):
        f.stacked([jnp.ones((1, 4, 8)), jnp.ones((2, 4, 8))], [None, jnp.ones((3,))])


@pytest.mark.slow
def test_stacked_with_given_norms():
    """``stacked(parts, norms)`` uses the given ‖X‖_F instead of computing it: with the true
    values it equals ``stacked(parts)`` (float64, 1e-12); a part given 3‖X‖ starts from
    X / (3‖X‖), exactly what ``X / 3`` with its own ‖X‖ gives, and not what ``stacked`` gives."""
    rng = np.random.default_rng(SEED)
    with jax.enable_x64(True):
        parts = [jnp.asarray(rng.standard_normal((b, 24, 64)) * s)
                 for b, s in zip((3, 2), (1e-3, 40.0))]
        sq = [jnp.sqrt(jnp.sum(p ** 2, axis=(1, 2))) for p in parts]
        f = BuiltinPolar(dion3_jax.make_orthogonalizer(method="gram", compute_dtype=jnp.float64,
                                                       backend="xla"))
        want = np.asarray(f.stacked(parts))
        got = np.asarray(jax.jit(f.stacked)(parts, [sq[0], sq[1]]))
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
        np.testing.assert_allclose(np.asarray(f.stacked(parts, [None, sq[1]])), want, rtol=0,
                                   atol=1e-12)
        off = np.asarray(f.stacked(parts, [sq[0], 3.0 * sq[1]]))
        np.testing.assert_allclose(off[:3], want[:3], rtol=0, atol=1e-12)
        third = np.asarray(f.stacked([parts[1] / 3.0], [sq[1]]))
        # (equal up to where eps enters: X/(3‖X‖ + eps) against (X/3)/(‖X‖ + eps))
        np.testing.assert_allclose(off[3:], third, rtol=0, atol=1e-9)
        assert np.max(np.abs(off[3:] - want[3:])) > 1e-3


@pytest.mark.parametrize("method", ["gram", "standard"])
def test_out_dtype_is_the_cast_result(method):
    """``out_dtype`` = compute dtype returns the iteration's own values: exactly the default
    (float32) result cast back, since compute → float32 → compute is exact."""
    x = jnp.asarray(np.random.default_rng(SEED).standard_normal((3, 24, 64), np.float32))
    compute = jnp.float16 if method == "gram" else jnp.bfloat16
    got = jax.jit(lambda x: polar(x, method=method, backend="xla", out_dtype=compute))(x)
    want = jax.jit(lambda x: polar(x, method=method, backend="xla"))(x)
    assert got.dtype == compute and want.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want))
    empty = polar(jnp.zeros((0, 4, 8)), method=method, out_dtype=compute)
    assert empty.shape == (0, 4, 8) and empty.dtype == compute


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_plain_product_writes_16_bits_rounded_once(dtype):
    """Gram NS's plain ``Q·X`` returns the operands' 16-bit dtype and equals the float32-
    accumulated product rounded once (to one 16-bit ulp; bitwise on XLA's CPU and on the H200)."""
    from dion3_jax import _polar

    rng = np.random.default_rng(SEED)
    q = jnp.asarray(rng.standard_normal((2, 48, 96)) / 10, dtype)
    x = jnp.asarray(rng.standard_normal((2, 96, 160)), dtype)
    out = jax.jit(_polar._matmul)(q, x)
    want = np.matmul(np.asarray(q, np.float64), np.asarray(x, np.float64))
    assert out.dtype == dtype
    ulp = np.abs(np.asarray(jnp.asarray(want, dtype), np.float64)) * float(jnp.finfo(dtype).eps)
    assert np.all(np.abs(np.asarray(out, np.float64) - want) <= ulp + 1e-6)


@pytest.mark.parametrize("method", ["gram", "standard"])
@pytest.mark.parametrize("scale", [2.0 ** 66, 2.0 ** 90])
def test_polar_of_huge_finite_input_equals_polar_of_the_unscaled(method, scale):
    """‖X‖_F² overflows float32 once entries pass ~1.8e19 (2⁶⁶ ≈ 7e19, 2⁹⁰ ≈ 1e27); the norm must
    not (else X/inf = 0 and the polar factor is silently zero). A power-of-two scale leaves every
    rounding unchanged, so polar(s·X) = polar(X) to float32 rounding of the cast, on fresh
    inputs and in the default float16/bfloat16 iteration."""
    x = np.random.default_rng(SEED).standard_normal((2, 16, 48)).astype(np.float32)
    want = np.asarray(polar(jnp.asarray(x), method=method, backend="xla"), np.float32)
    got = np.asarray(polar(jnp.asarray(x) * scale, method=method, backend="xla"), np.float32)
    assert np.all(np.isfinite(got)) and np.abs(got).max() > 0.1
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def test_polar_of_1e20_times_x_in_float32():
    """The issue's case, ×1e20 (not a power of two), in a float32 iteration: the same factor to
    float32 rounding."""
    x = np.random.default_rng(SEED).standard_normal((2, 16, 48)).astype(np.float32)
    kw = dict(method="standard", compute_dtype=jnp.float32, backend="xla")
    with jax.default_matmul_precision("highest"):
        want = np.asarray(polar(jnp.asarray(x), **kw))
        got = np.asarray(polar(jnp.asarray(x) * 1e20, **kw))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_polar_beyond_the_norm_range_is_nan_not_zero():
    """Past ~7e28 the Frobenius norm overflows even scaled: the result is NaN (detectable, e.g.
    by optax.apply_if_finite), never a silent zero."""
    x = np.random.default_rng(SEED).standard_normal((1, 8, 24)).astype(np.float32) * 1e36
    got = np.asarray(polar(jnp.asarray(x), backend="xla"), np.float32)
    assert np.all(np.isnan(got))


@pytest.mark.parametrize("shape", [(3, 16, 40), pytest.param((2, 40, 16), marks=pytest.mark.slow),
                                   pytest.param((2, 24, 24), marks=pytest.mark.slow)])
def test_of_normalized_is_polar_of_the_normalized_input(shape):
    """The built-in operator's ``of_normalized`` (what Dion3 calls on payloads it normalized
    and cast itself) gives the bits of ``polar`` on the same input, which normalizes first:
    dividing a float16 matrix of unit norm by ``1 + eps`` again rounds back to it."""
    orth = BuiltinPolar(dion3_jax.make_orthogonalizer(backend="xla"))
    x = jnp.asarray(np.random.default_rng(SEED).standard_normal(shape, np.float32))
    y = (x / (jnp.linalg.norm(x, axis=(1, 2), keepdims=True) + orth.eps)).astype(
        orth.input_dtype)
    want = jax.jit(orth)(y)
    got = jax.jit(orth.of_normalized)(y)
    assert got.dtype == want.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("restarts", [(2,), (1, 3)])
def test_gram_ns_adds_the_identity_in_place(restarts):
    """Each (re)start's ``Q = Z + a·I`` updates ``Z``'s diagonal in place once ``Z``'s other
    readers are done: one scatter per (re)start and no pass that copies a Gram-sized matrix
    (before, ``Z + a·eye`` read and wrote all of ``Z`` while ``Z`` stayed live)."""
    import re

    from dion3_jax import _polar
    from dion3_jax._coefficients import get_coefficients

    x = jnp.asarray(_rand((2, 48, 160), 3), jnp.float32)
    coeffs = get_coefficients("polar_express")
    hlo = jax.jit(lambda x: _polar.gram_newton_schulz(x, coeffs, restarts, backend="xla")
                  ).lower(x).compile().as_text()
    assert hlo.count(" scatter(") == len(restarts) + 1, hlo
    assert not re.search(r"f32\[2,48,48\]\{[0-9,]*\} copy\(", hlo), hlo
    assert not re.search(r"\[(2,)?48,48\]\{[0-9,]*\} iota\(", hlo), hlo  # no identity is built


# The fast loop: the default (Gram, float16) on the default preset and on user coefficients
# (wide and tall); its other two presets and the other methods and dtypes with the slow tests,
# each case on one of the two shapes.
_SLOW = pytest.mark.slow
_ALL = (0, 1, 2, 3)


@pytest.mark.parametrize("method,dtype,which,both_shapes", [
    ("gram", jnp.float16, (0, 3), True),
    pytest.param("gram", jnp.float16, (1, 2), False, marks=_SLOW),
    pytest.param("standard", jnp.float32, _ALL, False, marks=_SLOW),
    pytest.param("gram", jnp.bfloat16, _ALL, False, marks=_SLOW),
    pytest.param("gram", jnp.float32, _ALL, False, marks=_SLOW),
    pytest.param("standard", jnp.float16, _ALL, False, marks=_SLOW),
    pytest.param("standard", jnp.bfloat16, _ALL, False, marks=_SLOW)],
    ids=lambda v: ("cases" + "".join(map(str, v)) if isinstance(v, tuple)
                   else ("both" if v else "one") if isinstance(v, bool) else None))
def test_steps_with_coefficient_operands_equal_the_unrolled_literals(method, dtype, which,
                                                                     both_shapes):
    """The iterations pass each step's coefficients as array operands (steps of one structure
    share one traced body); on the CPU they give the bits of the same steps written out with
    the coefficients as literals (``unrolled_newton_schulz``), for presets and user
    coefficients, wide and tall batches, several restart sets (``which`` of them); each case
    on both shapes or, without ``both_shapes``, on one (wide for even cases, tall for odd)."""
    import unrolled_newton_schulz as unrolled

    from dion3_jax._coefficients import get_coefficients

    cases = [("polar_express", (2,)), ("you", (1, 3)), ("jordan", ()),
             ([(3.1, -4.2, 1.7), (2.9, -2.1, 0.61), (2.2, -1.6, 0.43)], (1,))]
    shapes = ((2, 24, 72), (3, 72, 24))
    for j, (preset, restarts) in enumerate(cases):
        if j not in which:
            continue
        coeffs = get_coefficients(preset)
        for shape in shapes if both_shapes else shapes[j % 2:j % 2 + 1]:
            x = jnp.asarray(_rand(shape, 20 + j) / np.sqrt(shape[1] * shape[2]), dtype)
            if method == "gram":
                got = jax.jit(lambda x: newton_schulz.gram_newton_schulz(
                    x, coeffs, restarts, backend="xla"))(x)
                want = jax.jit(lambda x: unrolled.gram(x, coeffs, restarts))(x)
            else:
                got = jax.jit(lambda x: newton_schulz.standard_newton_schulz(
                    x, coeffs, backend="xla"))(x)
                want = jax.jit(lambda x: unrolled.standard(x, coeffs))(x)
            assert got.dtype == want.dtype == dtype
            np.testing.assert_array_equal(np.asarray(got, np.float32),
                                          np.asarray(want, np.float32), err_msg=str(preset))


def test_steps_of_one_structure_share_one_lowered_body():
    """The 5-step Gram iteration with one restart lowers three step bodies (first after a
    (re)start and later steps, each followed by another step or not), each once, called five
    times in all; standard Newton-Schulz lowers one step body called once per step."""
    import re

    from dion3_jax._coefficients import get_coefficients

    coeffs = get_coefficients("polar_express")
    x = jax.ShapeDtypeStruct((2, 24, 72), jnp.float16)
    text = jax.jit(lambda x: newton_schulz.gram_newton_schulz(x, coeffs, (2,), backend="xla")
                   ).lower(x).as_text()
    bodies = re.findall(r"func\.func private @(_gram_\w+)\(", text)
    calls = re.findall(r"call @(_gram_\w+)\(", text)
    assert len(bodies) == 3 and len(calls) == 5, (bodies, calls)
    text = jax.jit(lambda x: newton_schulz.standard_newton_schulz(x, coeffs, backend="xla")
                   ).lower(x).as_text()
    assert len(re.findall(r"func\.func private @_standard_step\w*\(", text)) == 1
    assert len(re.findall(r"call @_standard_step\w*\(", text)) == 5


# ---------------------------------------------------------------------------------------------
# Fewer steps: the Polar Express fit and the Gram preconditioning.


def test_polar_express_fit_reproduces_the_presets():
    """The coefficient fit (the paper's greedy minimax recipe) gives the published 5-step
    coefficients for [1e-3, 1] and the ``"polar_express_4"`` preset for [0.01, 1]."""
    from dion3_jax._coefficients import PRESETS, polar_express_coefficients

    np.testing.assert_allclose(polar_express_coefficients(1e-3, 5), PRESETS["polar_express"],
                               rtol=1e-12)
    np.testing.assert_allclose(polar_express_coefficients(0.01, 4), PRESETS["polar_express_4"],
                               rtol=1e-12)
    with pytest.raises(ValueError, match="lower"):
        polar_express_coefficients(0.0, 4)
    with pytest.raises(ValueError, match="steps"):
        polar_express_coefficients(0.01, 0)


def test_polar_express_4_converges_on_its_interval():
    """In exact arithmetic the 4 steps map every singular value of [0.01, 1] into
    [0.92, 1.014] (the fit's band, moved down by the 1.05 safety factor), and none of [0, 1]
    above 1.014."""
    s = np.concatenate([np.geomspace(0.01, 1, 20001), np.linspace(0, 1, 20001)])
    for a, b, c in newton_schulz.get_coefficients("polar_express_4"):
        s = a * s + b * s**3 + c * s**5
    assert 0.92 < s[:20001].min() and s.max() < 1.014, (s[:20001].min(), s.max())


def _aol_scales(y: np.ndarray) -> np.ndarray:
    """AOL's ``(Σⱼ |Rᵢⱼ|)^(-1/2)`` of the short side's Gram matrix, float64, ``(B, n)``."""
    g = y @ np.swapaxes(y, -1, -2) if y.shape[-2] <= y.shape[-1] else np.swapaxes(y, -1, -2) @ y
    return np.abs(g).sum(-1) ** -0.5


def _bound_scales(y: np.ndarray) -> np.ndarray:
    g = y @ np.swapaxes(y, -1, -2) if y.shape[-2] <= y.shape[-1] else np.swapaxes(y, -1, -2) @ y
    bound = np.minimum(np.abs(g).sum(-1).max(-1), np.linalg.norm(g, axis=(-2, -1)))
    return np.broadcast_to((bound ** -0.5)[:, None], g.shape[:-1])


@pytest.mark.parametrize("shape", [(2, 24, 80), (2, 80, 24), (1, 40, 40)])
@pytest.mark.parametrize("preconditioning", ["aol", "norm_bound"])
def test_preconditioning_is_newton_schulz_on_the_rescaled_input_float64(shape, preconditioning):
    """In float64, Gram NS (restarted or not) and standard NS with ``preconditioning`` equal
    standard NS on ``D X`` (wide) or ``X D`` (tall), ``D`` computed here in NumPy: the scales
    folded into the first ``Q`` (or ``Z``) are exact. Fresh inputs."""
    y = _rand(shape, 30)
    y = y / np.linalg.norm(y, axis=(-2, -1), keepdims=True)
    d = (_aol_scales if preconditioning == "aol" else _bound_scales)(y)
    scaled = y * (d[:, None, :] if shape[-2] > shape[-1] else d[:, :, None])
    coeffs = newton_schulz.get_coefficients("polar_express_4")
    with jax.enable_x64(True):
        want = np.asarray(newton_schulz.standard_newton_schulz(jnp.asarray(scaled), coeffs))
        got = [newton_schulz.standard_newton_schulz(jnp.asarray(y), coeffs,
                                                    preconditioning=preconditioning)]
        if shape[-1] != shape[-2]:
            got += [newton_schulz.gram_newton_schulz(jnp.asarray(y), coeffs, r,
                                                     preconditioning=preconditioning)
                    for r in ((), (1,), (2,))]
    for g in got:
        np.testing.assert_allclose(np.asarray(g), want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("shape", [(2, 24, 80), (2, 80, 24)])
def test_preconditioned_spectral_norm_is_at_most_one(shape):
    """Both rescalings bound the spectral norm of the rescaled input by 1 (float64)."""
    y = _rand(shape, 31) * np.geomspace(1e-3, 1, shape[-1])   # uneven columns
    for scales in (_aol_scales, _bound_scales):
        d = scales(y)
        scaled = y * (d[:, None, :] if shape[-2] > shape[-1] else d[:, :, None])
        assert np.linalg.norm(scaled, ord=2, axis=(-2, -1)).max() <= 1 + 1e-12
    with jax.enable_x64(True):
        r = jnp.asarray(y @ np.swapaxes(y, -1, -2) if shape[-2] < shape[-1]
                        else np.swapaxes(y, -1, -2) @ y)
        for kind, scales in (("aol", _aol_scales), ("norm_bound", _bound_scales)):
            np.testing.assert_allclose(np.asarray(_polar._gram_scales(r, kind)), scales(y),
                                       rtol=1e-6)


@pytest.mark.parametrize("preconditioning", ["none", "aol", "norm_bound"])
def test_norm_bound_keeps_the_polar_factor(preconditioning):
    """A convergent iteration reaches ``U Vᵀ`` with ``"norm_bound"`` (a scalar rescaling) as
    without; AOL's ``polar(D X)`` is another matrix (float64)."""
    x = _rand((48, 128), 32) * np.geomspace(0.1, 1, 48)[:, None]   # uneven rows
    u, _, vt = np.linalg.svd(x, full_matrices=False)
    with jax.enable_x64(True):
        o = np.asarray(polar(jnp.asarray(x), coefficients=[(2.0, -1.5, 0.5)] * 40,
                             restarts=(2, 10, 20, 30), compute_dtype=jnp.float64,
                             preconditioning=preconditioning))
    err = np.abs(o - u @ vt).max()
    assert err > 1e-2 if preconditioning == "aol" else err < 1e-6, err


@pytest.mark.parametrize("preconditioning", ["aol", "norm_bound"])
@pytest.mark.parametrize("method,shape", [("gram", (2, 100, 300)), ("gram", (2, 300, 100)),
                                          ("standard", (1, 130, 130))])
def test_preconditioned_padding_is_exact_and_zero_rows_stay_zero(preconditioning, method, shape):
    """Zero padding to the kernels' tiles gives the unpadded result (float64, XLA path), and an
    input with zero rows and columns gives zeros there and no NaN (float16)."""
    with jax.enable_x64(True):
        x = _rand(shape, 33)
        x = jnp.asarray(x / np.linalg.norm(x, axis=(-2, -1), keepdims=True), jnp.float64)
        coeffs = newton_schulz.get_coefficients("polar_express_4")
        plain = _polar._iterate(x, coeffs, method, (1,), "xla", None, preconditioning)
        padded = _polar._iterate(x, coeffs, method, (1,), "xla", (128, 64), preconditioning)
        np.testing.assert_allclose(np.asarray(padded), np.asarray(plain), rtol=0, atol=1e-12)
    z = np.asarray(_rand(shape, 34), np.float32)
    z[:, :7], z[:, :, -5:] = 0, 0
    o = np.asarray(polar(jnp.asarray(z), method=method, coefficients="polar_express_4",
                         restarts=(1,), preconditioning=preconditioning))
    assert np.isfinite(o).all() and not o[:, :7].any() and not o[:, :, -5:].any()
    assert not np.asarray(polar(jnp.zeros(shape), preconditioning=preconditioning)).any()


@pytest.mark.slow  # an option's accuracy claim; the default's stay in the fast loop
def test_four_preconditioned_steps_beat_the_default_on_gaussian_inputs():
    """On a Gaussian 128 × 512 input (aspect 4, as 4096 × 16384), the float16 Gram NS with
    ``"polar_express_4"``, ``"norm_bound"`` and no restart is closer to ``U Vᵀ`` than the default
    5 steps (singular values in the default's band 0.85–1.12 against 0.96–1.02: measured
    1.5e-2 against 9.7e-2 at 4096 × 16384, docs/POLAR.md)."""
    x = _rand((128, 512), 35)
    u, _, vt = np.linalg.svd(x, full_matrices=False)
    err = {}
    for name, kwargs in (("default", {}), ("pe4", dict(coefficients="polar_express_4",
                                                        restarts=(),
                                                        preconditioning="norm_bound"))):
        o = np.asarray(polar(jnp.asarray(x, jnp.float32), **kwargs), np.float64)
        err[name] = np.linalg.norm(o - u @ vt) / np.linalg.norm(u @ vt)
    assert err["pe4"] < 0.04 < 0.06 < err["default"], err


def test_preconditioning_is_validated():
    x = jnp.ones((4, 8))
    with pytest.raises(ValueError, match="preconditioning"):
        polar(x, preconditioning="diag")
    with pytest.raises(ValueError, match="preconditioning"):
        dion3_jax.make_orthogonalizer(preconditioning="diag")
    f = dion3_jax.make_orthogonalizer(coefficients="polar_express_4", restarts=(),
                                      preconditioning="norm_bound", backend="xla")
    np.testing.assert_array_equal(
        np.asarray(f(x[None])), np.asarray(polar(x[None], coefficients="polar_express_4",
                                                 restarts=(), preconditioning="norm_bound")))
