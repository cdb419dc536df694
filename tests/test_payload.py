"""``pallas_kernels.stack_payloads``: the fully selected matrices' payload pass.

The jnp reference against a float64 NumPy computation; the Pallas kernel (through Pallas'
interpreter on the CPU) bitwise against the reference; its Triton lowering for an H200 at the
benchmark's shapes; the Dion3 step at f = 1 with the kernel bitwise against the step with XLA.
The kernel on a GPU is in ``tests/test_kernels_gpu.py``.
"""

import contextlib
import functools

import jax
from jax.sharding import (AbstractDevice, AbstractMesh, AxisType, NamedSharding,
                          PartitionSpec as P, use_abstract_mesh)
import jax.numpy as jnp
import numpy as np
import pytest

import dion3_jax
import pallas_kernels
from dion3_jax import _step
from pallas_kernels import stack_payloads, stack_payloads_reference
from pallas_kernels._payload import block_shape


def _members(seed, batches, rows, cols, m_dtype=jnp.float32, g_dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 3 * len(batches))
    ms = [jax.random.normal(keys[3 * i], (b, rows, cols)).astype(m_dtype)
          for i, b in enumerate(batches)]
    gs = [jax.random.normal(keys[3 * i + 1], (b, rows, cols)).astype(g_dtype)
          for i, b in enumerate(batches)]
    ds = [jax.random.uniform(keys[3 * i + 2], (b,), minval=0.5, maxval=4.0)
          for i, b in enumerate(batches)]
    return ms, gs, ds


@pytest.mark.parametrize("m_dtype,g_dtype", [(jnp.float32, jnp.float32),
                                             (jnp.float32, jnp.bfloat16),
                                             (jnp.bfloat16, jnp.float32)])
def test_reference_matches_float64(m_dtype, g_dtype):
    """``S = M + G`` with ``G`` cast to M's dtype (the definition) computed in float64: the
    payload within one float16 rounding plus the sum's rounding in M's dtype, the decayed
    momentum within two roundings of M's dtype."""
    ms, gs, ds = _members(np.random.randint(1 << 30), [2, 1, 3], 24, 96, m_dtype, g_dtype)
    mu = 0.9
    stack, decayed = jax.jit(functools.partial(stack_payloads_reference, out_dtype=jnp.float16))(
        ms, gs, ds, mu)
    assert stack.shape == (6, 24, 96) and stack.dtype == jnp.float16
    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    terms = [(f64(m), f64(g.astype(m_dtype))) for m, g in zip(ms, gs)]
    eps = float(jnp.finfo(m_dtype).eps)
    scale = np.concatenate([(abs(m) + abs(g)) / f64(d)[:, None, None]
                            for (m, g), d in zip(terms, ds)])
    want = np.concatenate([(m + g) / f64(d)[:, None, None] for (m, g), d in zip(terms, ds)])
    assert np.all(abs(f64(stack) - want) <= 2.0 ** -11 * abs(want) + eps * scale + 1e-7)
    for (m, g), got, src in zip(terms, decayed, ms):
        assert got.dtype == src.dtype
        assert np.all(abs(f64(got) - mu * (m + g)) <= 2 * eps * mu * (abs(m) + abs(g)) + 1e-7)


@pytest.mark.parametrize("batches,rows,cols", [([2, 1, 3], 24, 96), ([1], 8, 32),
                                               ([4, 4], 64, 1024), ([1, 2], 12, 160)])
def test_kernel_interpreted_equals_reference_bitwise(batches, rows, cols):
    ms, gs, ds = _members(np.random.randint(1 << 30), batches, rows, cols, g_dtype=jnp.bfloat16)
    mu = jnp.float32(0.8)
    want = jax.jit(functools.partial(stack_payloads_reference, out_dtype=jnp.float16))(
        ms, gs, ds, mu)
    got = jax.jit(functools.partial(stack_payloads, out_dtype=jnp.float16,
                                    implementation="pallas", interpret=True))(ms, gs, ds, mu)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    for a, b in zip(got[1], want[1]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_block_shapes():
    assert block_shape(4096, 11008) == (16, 256)
    assert block_shape(11008, 4096) == (8, 512)
    assert block_shape(24, 96) == (8, 32)
    assert block_shape(64, 20) is None      # no power-of-two column block of 32 or more


def test_bad_input_raises():
    ms, gs, ds = _members(0, [1, 2], 8, 32)
    with pytest.raises(ValueError, match="implementation must be one of"):
        stack_payloads(ms, gs, ds, 0.9, out_dtype=jnp.float16, implementation="cuda")
    with pytest.raises(ValueError, match=r"member 1: momentum \(2, 8, 32\) and gradient"):
        stack_payloads(ms, [gs[0], gs[0]], ds, 0.9, out_dtype=jnp.float16)
    with pytest.raises(ValueError, match=r"member 0: norms must be \(1,\)"):
        stack_payloads(ms, gs, [ds[1], ds[1]], 0.9, out_dtype=jnp.float16)
    with pytest.raises(ValueError, match="as many momenta"):
        stack_payloads([], [], [], 0.9, out_dtype=jnp.float16)
    narrow = _members(0, [1], 8, 20)
    with pytest.raises(ValueError, match=r"multiple of 32, got \(8, 20\)"):
        stack_payloads(*narrow, 0.9, out_dtype=jnp.float16, implementation="pallas",
                       interpret=True)
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match="runs on NVIDIA GPUs"):
            stack_payloads(ms, gs, ds, 0.9, out_dtype=jnp.float16, implementation="pallas")


def test_kernel_lowers_for_h200_at_benchmark_shapes():
    """The Triton lowering of the kernel succeeds for an H200 (no GPU needed; not compiled)."""
    mesh = AbstractMesh((1,), ("x",), axis_types=(AxisType.Explicit,),
                        abstract_device=AbstractDevice("NVIDIA H200", 132, "gpu"))
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    fn = jax.jit(functools.partial(stack_payloads, out_dtype=jnp.float16,
                                   implementation="pallas", interpret=False))
    for rows, cols in ((4096, 11008), (11008, 4096)):
        with use_abstract_mesh(mesh):
            text = fn.trace([f32(1, rows, cols)] * 3, [f32(1, rows, cols)] * 3, [f32(1)] * 3,
                            f32()).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("stack_payloads") >= 3, text[:2000]


_SPECS = {"a": P(None, "x"), "b": P(None, "x"), "c": P("x", None, None), "d": P("x", None)}


@pytest.mark.parametrize("sharded", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.parametrize("mu_dtype", [None, jnp.bfloat16])
def test_step_with_the_kernel_equals_the_step_with_xla(monkeypatch, sharded, mu_dtype):
    """At f = 1 every matrix goes through the payload pass (on one device, and on an 8-device
    FSDP mesh, where the stack is what the all-to-all sends); with the kernel (interpreted)
    three steps give the same bits as with XLA, for float32 and bfloat16 momenta."""
    params = {"a": jnp.ones((16, 256)), "b": jnp.ones((16, 256)), "c": jnp.ones((8, 64, 32)),
              "d": jnp.ones((64, 32))}
    keys = iter(jax.random.split(jax.random.key(np.random.randint(1 << 30)), 12))
    grads = [{k: jax.random.normal(next(keys), v.shape) for k, v in params.items()}
             for _ in range(3)]
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,),
                         devices=jax.devices("cpu")[:8]) if sharded else None

    def put(tree):
        if mesh is None:
            return tree
        return {k: jax.device_put(v, NamedSharding(mesh, _SPECS[k])) for k, v in tree.items()}

    def run():
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            tx = dion3_jax.scale_by_dion3(1.0, mu_dtype=mu_dtype)
            state, outs = tx.init(put(params)), []
            step = jax.jit(tx.update)
            for g in grads:
                u, state = step(put(g), state)
                outs.append(u)
            return jax.tree.leaves((outs, state))

    want = run()
    calls, original = [], pallas_kernels.stack_payloads

    def kernel(*args, **kwargs):
        calls.append(kwargs["implementation"])
        return original(*args, **{**kwargs, "implementation": "pallas", "interpret": True})

    monkeypatch.setattr(_step.pallas_kernels, "stack_payloads", kernel)
    got = run()
    assert calls, "the step did not use the payload pass"
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(np.any(np.asarray(x) != 0) for x in want)
