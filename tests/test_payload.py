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
"""``pallas_kernels.stack_payloads``: the payload pass, of every row or of selected rows.

The jnp reference against a float64 NumPy computation on fresh inputs; the Pallas kernel (through
Pallas' interpreter on the CPU) bitwise against the reference; its Triton lowering for an H200 at
the benchmark's shapes; the Dion3 step at f = 1 and f = 1/4 with the kernel bitwise against the step
with XLA. The kernel on a GPU is in ``tests/test_kernels_gpu.py``.
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
from pallas_kernels import _payload_triton
from pallas_kernels._payload_triton import PayloadConfig, block_shape
from seeds import module_seed

#: Fresh random inputs per run, printed with every test (tests/seeds.py).
SEED = module_seed()


def _members(seed, batches, rows, cols, dtype=jnp.float32):
    """Summed momenta ``S`` of the members and the stack's norms, one per matrix (drawn by
    NumPy: jax.random would compile its sampler anew for every shape)."""
    rng = np.random.default_rng(seed)
    sums = [jnp.asarray(rng.standard_normal((b, rows, cols), np.float32).astype(dtype))
            for b in batches]
    ds = jnp.asarray(rng.uniform(0.5, 4.0, sum(batches)).astype(np.float32))
    return sums, ds


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_reference_matches_float64(dtype):
    """Every row: the stack is ``S/d`` within one float16 rounding."""
    sums, ds = _members(SEED, [2, 1, 3], 24, 96, dtype)
    stack = jax.jit(functools.partial(stack_payloads_reference, out_dtype=jnp.float16))(sums, ds)
    assert stack.shape == (6, 24, 96) and stack.dtype == jnp.float16
    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    want = np.concatenate([f64(s) for s in sums]) / f64(ds)[:, None, None]
    assert np.all(abs(f64(stack) - want) <= 2.0 ** -11 * abs(want) + 1e-7)


@pytest.mark.parametrize("batches,rows,cols,dtype", [
    ([2, 1, 3], 24, 96, jnp.float32), ([1], 8, 32, jnp.float32), ([4, 4], 64, 1024, jnp.float32),
    ([1, 2], 12, 160, jnp.float32), ([2, 1], 24, 96, jnp.bfloat16)])
def test_kernel_interpreted_equals_reference_bitwise(batches, rows, cols, dtype):
    sums, ds = _members(SEED, batches, rows, cols, dtype)
    want = jax.jit(functools.partial(stack_payloads_reference, out_dtype=jnp.float16))(sums, ds)
    got = jax.jit(functools.partial(stack_payloads, out_dtype=jnp.float16,
                                    implementation="pallas_triton", interpret=True))(sums, ds)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _rows(seed, batches, n, pick, padded):
    """``(Σ batch, pick)``: per matrix of the stack, ascending distinct rows of ``[0, n)``;
    with ``padded``, the last two of the first matrix are padding (≥ n)."""
    rng = np.random.default_rng(seed)
    r = np.stack([np.sort(rng.choice(n, pick, replace=False)) for _ in range(sum(batches))])
    if padded:
        r[0, -2:] = [n, n + 5]
    return jnp.asarray(r, jnp.int32)


@pytest.mark.parametrize("row_axis", [1, 2])
def test_selected_rows_reference_matches_float64(row_axis):
    """With ``rows``: the payload is ``S[rows]/d`` (zeros for padding rows) within one float16
    rounding."""
    seed = SEED
    sums, ds = _members(seed, [2, 1], 48, 64)
    n = sums[0].shape[row_axis]
    rows = _rows(seed, [2, 1], n, n // 4, padded=True)
    stack = jax.jit(functools.partial(stack_payloads_reference, out_dtype=jnp.float16,
                                      row_axis=row_axis))(sums, ds, rows=rows)
    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    got = np.moveaxis(f64(stack), row_axis, 1)
    s = np.moveaxis(np.concatenate([f64(x) for x in sums]), row_axis, 1)
    r, d = np.asarray(rows), f64(ds)
    want = np.stack([np.where((r[j] < n)[:, None], s[j][np.minimum(r[j], n - 1)], 0) / d[j]
                     for j in range(s.shape[0])])
    assert stack.shape[0] == 3 and got.shape == want.shape
    assert np.all(abs(got - want) <= 2.0 ** -11 * abs(want) + 1e-7)
    assert np.all(got[0, -2:] == 0)


# Padding rows (slow) once per row axis: which rows are padding does not depend on the column
# blocks that (24, 160) adds.
@pytest.mark.parametrize("row_axis,shape,padded", [
    (1, (64, 96), False), (2, (32, 128), False), (2, (24, 160), False),
    pytest.param(1, (64, 96), True, marks=pytest.mark.slow),
    pytest.param(2, (32, 128), True, marks=pytest.mark.slow)])
def test_selected_rows_kernel_interpreted_equals_reference_bitwise(row_axis, shape, padded):
    seed = SEED
    sums, ds = _members(seed, [2, 1, 3], *shape)
    n = shape[row_axis - 1]
    rows = _rows(seed, [2, 1, 3], n, n // 4, padded)
    run = lambda impl: jax.jit(functools.partial(  # noqa: E731
        stack_payloads, out_dtype=jnp.float16, row_axis=row_axis, padded=padded,
        implementation=impl, interpret=True))(sums, ds, rows=rows)
    np.testing.assert_array_equal(np.asarray(run("pallas_triton")), np.asarray(run("xla")))


@pytest.mark.parametrize("row_axis,padded", [(1, False), (2, False), (2, True)])
def test_pad_to_appends_zero_rows(row_axis, padded):
    """``pad_to``: the payloads of the selected rows, then zero rows up to ``pad_to`` (the
    kernel zeroes them after its launches unless the whole stack was zeroed; the interpreter
    fills unwritten memory with NaN); kernel and XLA bitwise equal."""
    seed = SEED
    shape = (64, 96) if row_axis == 1 else (32, 128)
    sums, ds = _members(seed, [2, 1], *shape)
    n = shape[row_axis - 1]
    pick, rows = n // 4, _rows(seed, [2, 1], n, n // 4, padded)
    run = lambda impl, pad_to: jax.jit(functools.partial(  # noqa: E731
        stack_payloads, out_dtype=jnp.float16, row_axis=row_axis, padded=padded,
        pad_to=pad_to, implementation=impl, interpret=True))(sums, ds, rows=rows)
    plain = run("xla", None)
    for impl in ("xla", "pallas_triton"):
        stack = run(impl, pick + 7)
        assert stack.shape[row_axis] == pick + 7
        head, tail = np.split(np.asarray(stack), [pick], axis=row_axis)
        np.testing.assert_array_equal(head, np.asarray(plain))
        np.testing.assert_array_equal(tail, np.zeros_like(tail))


def test_block_shapes():
    assert block_shape(4096, 11008) == (16, 256)
    assert block_shape(11008, 4096) == (8, 512)
    assert block_shape(24, 96) == (8, 32)
    assert block_shape(64, 20) is None      # no power-of-two column block of 32 or more
    assert block_shape(4096, 11008, PayloadConfig(block_elements=2048)) == (8, 256)
    assert block_shape(4096, 4096, PayloadConfig(max_block_cols=128)) == (32, 128)


@pytest.mark.parametrize("row_axis", [None, 1, 2])
def test_launch_parameters_do_not_change_the_result(row_axis):
    """Other blocks and warps (``PayloadConfig``, what ``bench_payload.py`` times) give the
    default's bits: every element is computed alone. ``row_axis`` None: every row."""
    seed = SEED
    sums, ds = _members(seed, [2, 1], 32, 128)
    rows = None if row_axis is None else _rows(seed, [2, 1], (32, 128)[row_axis - 1],
                                               (8, 32)[row_axis - 1], padded=False)
    configs = (PayloadConfig(), PayloadConfig(block_elements=512, max_block_cols=32, num_warps=8))
    outs = [jax.jit(functools.partial(
        _payload_triton.stack_payloads_triton, out_dtype=jnp.float16, rows=rows,
        row_axis=row_axis or 1, padded=False, interpret=True, config=c))(sums, ds)
        for c in configs]
    assert block_shape(32, 128, configs[1]) == (16, 32)
    for out in outs[1:]:
        np.testing.assert_array_equal(np.asarray(out), np.asarray(outs[0]))


def test_bad_input_raises():
    sums, ds = _members(0, [1, 2], 8, 32)
    f16 = jnp.float16
    with pytest.raises(ValueError, match="implementation must be one of"):
        stack_payloads(sums, ds, out_dtype=f16, implementation="cuda")
    with pytest.raises(ValueError, match=r"member 1: sums \(2, 8, 64\) must be"):
        stack_payloads([sums[0], jnp.zeros((2, 8, 64))], ds, out_dtype=f16)
    with pytest.raises(ValueError, match=r"denoms must be an array of one divisor per matrix "
                                         r"of the stack, \(3,\), got <class 'list'>"):
        stack_payloads(sums, [ds[:1], ds[1:]], out_dtype=f16)
    with pytest.raises(ValueError, match="at least one member"):
        stack_payloads([], ds, out_dtype=f16)
    with pytest.raises(ValueError, match=r"\(3,\), got \(1,\)"):
        stack_payloads(sums, ds[:1], out_dtype=f16)
    narrow = _members(0, [1], 8, 20)
    with pytest.raises(ValueError, match=r"multiple of 32, got \(8, 20\)"):
        stack_payloads(*narrow, out_dtype=f16, implementation="pallas_triton", interpret=True)
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match="needs an NVIDIA GPU"):
            stack_payloads(sums, ds, out_dtype=f16, implementation="pallas_triton")
    rows = jnp.zeros((3, 2), jnp.int32)
    with pytest.raises(ValueError, match="row_axis must be 1 or 2, got 0"):
        stack_payloads(sums, ds, out_dtype=f16, rows=rows, row_axis=0)
    with pytest.raises(ValueError, match=r"rows must be an integer array \(3, pick\).* got "
                                         r"int32 \(1, 2\)"):
        stack_payloads(sums, ds, out_dtype=f16, rows=rows[:1])
    with pytest.raises(ValueError, match=r"pad_to needs rows and must be at least their count 2, "
                                         r"got pad_to=1"):
        stack_payloads(sums, ds, out_dtype=f16, rows=rows, pad_to=1)
    with pytest.raises(ValueError, match="pad_to needs rows"):
        stack_payloads(sums, ds, out_dtype=f16, pad_to=4)
    with pytest.raises(ValueError, match=r"rows must be an integer array.* got float32"):
        stack_payloads(sums, ds, out_dtype=f16, rows=rows.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"rows must be an integer array.* got <class 'list'>"):
        stack_payloads(sums, ds, out_dtype=f16, rows=[rows[:1], rows[1:]])


def test_kernel_lowers_for_h200_at_benchmark_shapes():
    """The Triton lowering of the kernel succeeds for an H200 (no GPU needed; not compiled);
    without rows its launches write into one uninitialized stack."""
    mesh = AbstractMesh((1,), ("x",), axis_types=(AxisType.Explicit,),
                        abstract_device=AbstractDevice("NVIDIA H200", 132, "gpu"))
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    fn = jax.jit(functools.partial(stack_payloads, out_dtype=jnp.float16,
                                   implementation="pallas_triton", interpret=False))
    for rows, cols in ((4096, 11008), (11008, 4096)):
        with use_abstract_mesh(mesh):
            text = fn.trace([f32(1, rows, cols)] * 3, f32(3)).lower(
                lowering_platforms=("cuda",)).as_text()
        assert text.count("stack_payloads") >= 3, text[:2000]
        # Every launch writes into one uninitialized stack in place: nothing clears it.
        assert text.count("custom_call @AllocateBuffer") == 1, text[:2000]
        rows = jax.ShapeDtypeStruct((2, 1376), jnp.int32)
        fn = jax.jit(functools.partial(stack_payloads, out_dtype=jnp.float16, row_axis=2,
                                       implementation="pallas_triton", interpret=False))
        with use_abstract_mesh(mesh):
            text = fn.trace([f32(1, 4096, 5504)] * 2, f32(2), rows=rows).lower(
                lowering_platforms=("cuda",)).as_text()
        assert text.count("stack_payloads") >= 2, text[:2000]


_SPECS = {"a": P(None, "x"), "b": P(None, "x"), "c": P("x", None, None), "d": P("x", None)}


def _three_steps(make_tx, params, sharded: bool, options=None) -> list:
    """A function that runs three steps of ``make_tx()`` (compiled with XLA ``options``) and
    returns the leaves of the updates and the final state: on one device or, with ``sharded``,
    on an 8-device mesh with the leaves laid out by ``_SPECS``. The three gradients are drawn
    here, fresh, so every call of the function sees the same ones."""
    rng = np.random.default_rng(SEED)
    grads = [{k: jnp.asarray(rng.standard_normal(v.shape, np.float32)) for k, v in params.items()}
             for _ in range(3)]
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,),
                         devices=jax.devices("cpu")[:8]) if sharded else None

    def put(tree):
        if mesh is None:
            return tree
        return {k: jax.device_put(v, NamedSharding(mesh, _SPECS[k])) for k, v in tree.items()}

    def run():
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            tx = make_tx()
            state, outs = tx.init(put(params)), []
            step = jax.jit(tx.update).lower(put(grads[0]), state).compile(
                compiler_options=options)
            for g in grads:
                u, state = step(put(g), state)
                outs.append(u)
            return jax.tree.leaves((outs, state))

    return run


# The fast loop: f = 1/4 with bfloat16 momenta on one device. The slow tests add the mesh at
# f = 1/4 (selected rows of row shards, column shards and a batch-sharded stack) and f = 1 on one
# device. Float32 momenta at f = 1/4 add nothing: the kernel's float32 selected rows are checked
# bitwise above; nor do bfloat16 momenta at f = 1 (checked bitwise above; the step hands the
# kernel the momenta whatever their dtype), nor f = 1 on the mesh (every row: the same launches
# on the shards the f = 1/4 mesh case already stacks).
@pytest.mark.slow  # ~7 s; the fast loop keeps the kernel against its reference, bitwise
@pytest.mark.parametrize("sharded,mu_dtype,fraction", [
    (False, jnp.bfloat16, 0.25),
    pytest.param(True, jnp.bfloat16, 0.25, marks=pytest.mark.slow),
    pytest.param(False, None, 1.0, marks=pytest.mark.slow)])
def test_step_with_the_kernel_equals_the_step_with_xla(monkeypatch, sharded, mu_dtype, fraction):
    """Every matrix goes through the payload pass, at f = 1 and with selected rows at f = 1/4 (on
    one device, and on an 8-device mesh: FSDP row shards, column shards, a batch-sharded stack;
    the stack is what the all-to-all sends); with the kernel (interpreted) three steps give the
    same bits as with XLA, for float32 and bfloat16 momenta."""
    params = {"a": jnp.ones((16, 256)), "b": jnp.ones((16, 256)), "c": jnp.ones((8, 64, 32)),
              "d": jnp.ones((64, 32))}
    # XLA may keep a bfloat16 M + G in float32 for the payload where the kernel rounds it;
    # without that license the two agree bitwise.
    run = _three_steps(lambda: dion3_jax.scale_by_dion3(fraction, mu_dtype=mu_dtype), params,
                       sharded, {"xla_allow_excess_precision": False})
    want = run()
    calls, original = [], pallas_kernels.stack_payloads

    def kernel(*args, **kwargs):
        calls.append(kwargs["rows"] is None)
        return original(*args, **{**kwargs, "implementation": "pallas_triton", "interpret": True})

    monkeypatch.setattr(_step.pallas_kernels, "stack_payloads", kernel)
    got = run()
    assert calls and all(full == (fraction == 1) for full in calls), calls
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert any(np.any(np.asarray(x) != 0) for x in want)


# The XLA payload pass pads the same way (it is the kernel's reference, checked bitwise above):
# the kernel on one device, and XLA on the mesh, with the slow tests (the fast loop checks the
# padding itself in test_pad_to_appends_zero_rows).
@pytest.mark.slow
@pytest.mark.parametrize("kernel,sharded", [(True, False), (False, True)])
def test_step_with_a_padded_stack_equals_the_step_without(monkeypatch, kernel, sharded):
    """Where the iteration pads the picked axis (here: multiples of 16 on XLA, as the kernels
    pad to theirs), the payload pass writes the stack so padded (``pad_to``) and the factors are
    sliced after the iteration. Three steps at f = 1/4 equal the step whose iteration pads the
    stack itself, within float32 rounding (the padded products may sum in another order; fresh
    inputs); ``kernel``: the payload pass through the interpreted kernel; ``sharded``: on an
    8-device mesh, ``c`` batch-sharded (its group stays on each device) and ``a``, ``b``
    column-sharded (all-to-all groups: never padded by the payload pass)."""
    from dion3_jax import _polar

    params = {"a": jnp.ones((24, 224)), "b": jnp.ones((24, 224)),
              "c": jnp.ones((8 if sharded else 3, 48, 96))}
    run = _three_steps(lambda: dion3_jax.scale_by_dion3(0.25), params, sharded)
    monkeypatch.setattr(_polar, "_multiples", lambda y, backend: (16, 8))
    original, pads = pallas_kernels.stack_payloads, []

    def no_pad(*args, **kwargs):
        return original(*args, **{**kwargs, "pad_to": None})

    monkeypatch.setattr(_step.pallas_kernels, "stack_payloads", no_pad)
    want = run()  # the iteration pads the stack

    def spy(*args, **kwargs):
        pads.append((kwargs["pad_to"], kwargs["rows"].shape[1]))
        extra = {"implementation": "pallas_triton", "interpret": True} if kernel else {}
        return original(*args, **{**kwargs, **extra})

    monkeypatch.setattr(_step.pallas_kernels, "stack_payloads", spy)
    got = run()
    # c: 24 of 96 columns picked, padded to 32; a, b: (24, 56) payloads, whose other axis the
    # iteration pads too (24 → 32), so their stack stays as it is (on the mesh: all-to-all).
    assert (32, 24) in pads and all(p is None for p, _ in pads if (p, _) != (32, 24)), pads
    assert sharded or set(pads) == {(32, 24), (None, 56)}, pads
    for x, y in zip(got, want):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=1e-6)
    assert any(np.any(np.asarray(x) != 0) for x in want)
