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
"""16-bit parameters are rounded once per step: ``W_new`` is the 16-bit rounding of the float32
value ``(1 − lr·wd)·W − lr·scale·D`` (``D`` the step's direction, zero off the selected rows),
through ``optax.apply_updates`` and ``nnx.Optimizer``.

The reference rounds the float64 value once. A float32 evaluation may round the other way only
where that value lies within a few float32 ulps of a 16-bit rounding boundary: those elements
(about 1e-4 of them in bfloat16, 1e-3 in float16) may take any value between the roundings of
the two ends of that band; every other element must match bitwise.
"""

from __future__ import annotations

import functools

from flax import nnx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import dion3_jax
from seeds import module_seed

#: Every run draws fresh inputs (printed with each test by ``conftest.print_module_seed``).
SEED = module_seed()
STEPS = 3
SHAPE = (64, 128)


def _round(x: np.ndarray, dtype) -> np.ndarray:
    return x.astype(ml_dtypes.bfloat16 if dtype == jnp.bfloat16 else np.float16)


def assert_rounded_once(new, w, direction, lr: float, wd: float, what: str) -> None:
    """``new`` is the rounding of ``(1 − lr·wd)·w − lr·direction`` (computed in float64) to
    ``new``'s dtype, except that an element within ``tol`` (a few float32 ulps of the operands)
    of a rounding boundary may take any 16-bit value between the roundings of ``exact ± tol``.

    Rounding is monotone, so a float32 evaluation within ``tol`` of ``exact`` rounds into that
    interval. It can hold more than two values where the operands nearly cancel (``|exact|``
    far below ``|w|``), which is why the check is an interval, not a pair of neighbors."""
    w64, d64 = np.asarray(w, np.float64), np.asarray(direction, np.float64)
    exact = (1.0 - lr * wd) * w64 - lr * d64
    tol = 2.0 ** -22 * (np.abs(w64) + lr * np.abs(d64))
    lo, hi = _round(exact - tol, new.dtype), _round(exact + tol, new.dtype)
    got = np.asarray(new)
    ambiguous = lo != hi
    print(what, new.dtype, ambiguous.mean())
    # The band leaves all but a few elements to the bitwise check. Measured fractions (the four
    # configurations, 12 draws each): bfloat16 at most 6.1e-4; float16 median 1.1e-3, at most
    # 6.1e-3.
    bound = 2e-3 if new.dtype == jnp.bfloat16 else 1e-2
    assert ambiguous.mean() < bound, (what, ambiguous.mean())
    assert np.array_equal(lo[~ambiguous], _round(exact, new.dtype)[~ambiguous])
    g32 = got.astype(np.float32)
    wrong = (g32 < lo.astype(np.float32)) | (g32 > hi.astype(np.float32))
    assert not wrong.any(), (f"{what}: {int(wrong.sum())} of {wrong.size} elements are not the "
                             f"single rounding, e.g. {got[wrong][:3]} for {exact[wrong][:3]}")


@functools.cache
def _direction(fraction: float):
    """The float32 reference step (``scale_by_dion3`` with the float16 momentum that 16-bit
    parameters get) and its jitted update: one compile per fraction, shared by the tests."""
    direction = dion3_jax.scale_by_dion3(fraction, mu_dtype=jnp.float16)
    return direction, jax.jit(direction.update)


def _inputs(dtype, seed):
    rng = np.random.default_rng(seed)
    params = {"w": jnp.asarray(rng.standard_normal(SHAPE) * 0.5, dtype),
              "b": jnp.asarray(rng.standard_normal(SHAPE[1]), dtype)}
    # Global norm ≈ 27: clipped to 20, and its float16 sum of squares does not overflow.
    grads = [{k: jnp.asarray(rng.standard_normal(v.shape) * 0.3, dtype)
              for k, v in params.items()} for _ in range(STEPS)]
    return params, grads


# The fast loop: each dtype, fraction and learning rate once; the other four with the slow tests.
@pytest.mark.parametrize("dtype,fraction,wd,schedule", [
    (jnp.bfloat16, 0.25, 0.1, True), (jnp.bfloat16, 1.0, 0.0, False),
    (jnp.float16, 0.25, 0.0, False), (jnp.float16, 1.0, 0.1, True),
    *(pytest.param(*c, marks=pytest.mark.slow) for c in [
        (jnp.bfloat16, 0.25, 0.0, False), (jnp.bfloat16, 1.0, 0.1, True),
        (jnp.float16, 0.25, 0.1, True), (jnp.float16, 1.0, 0.0, False)])])
def test_16bit_params_are_rounded_once(dtype, fraction, wd, schedule):
    """``optax.chain(clip_by_global_norm, dion3)`` on 16-bit params, constant or scheduled
    learning rate: each step's new matrix is one rounding of the float32 update of the float32
    direction (the same step on the float32 copies of the clipped gradients)."""
    params, grads = _inputs(dtype, SEED + int(fraction * 4) + 10 * schedule)
    lr = optax.linear_schedule(0.05, 0.01, STEPS) if schedule else 0.03
    clip = optax.clip_by_global_norm(20.0)
    tx = optax.chain(clip, dion3_jax.dion3(lr, fraction, weight_decay=wd))
    # The same step on float32 inputs, with the float16 momentum that 16-bit parameters get.
    direction, direction_update = _direction(fraction)
    state, ref_state = tx.init(params), direction.init({"w": jnp.zeros(SHAPE)})
    for step, g in enumerate(grads):
        clipped, _ = jax.jit(clip.update)(g, clip.init(params))
        d, ref_state = direction_update({"w": clipped["w"].astype(jnp.float32)}, ref_state)
        upd, state = jax.jit(tx.update)(g, state, params)
        assert upd["w"].dtype == jnp.float32 and upd["b"].dtype == dtype
        new = optax.apply_updates(params, upd)
        assert new["w"].dtype == new["b"].dtype == dtype
        rate = float(lr(step)) if schedule else lr
        assert float(jnp.max(jnp.abs(d["w"]))) > 0
        assert_rounded_once(new["w"], params["w"], d["w"], rate, wd, f"step {step}")
        params = new


class _Tiny(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, dtype):
        self.l1 = nnx.Linear(SHAPE[0], SHAPE[1], param_dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return jnp.sum(jnp.tanh(self.l1(x)) ** 2)


@pytest.mark.slow   # the optax path above is the fast loop's check of the same rounding
def test_nnx_optimizer_rounds_bfloat16_kernels_once():
    """``nnx.Optimizer`` (which calls ``optax.apply_updates``) with bfloat16 kernels, f = 1/4."""
    model = _Tiny(nnx.Rngs(SEED % 1000), jnp.bfloat16)
    lr, wd = 0.02, 0.05
    opt = nnx.Optimizer(model, dion3_jax.dion3(lr, 0.25, weight_decay=wd), wrt=nnx.Param)
    direction, direction_update = _direction(0.25)   # bfloat16's default momentum, float16
    ref_state = direction.init({"w": jnp.zeros(SHAPE)})
    x = jnp.asarray(np.random.default_rng(SEED).standard_normal((16, SHAPE[0])), jnp.bfloat16)
    grad = nnx.jit(nnx.grad(lambda m: m(x)))
    update = nnx.jit(lambda opt, model, grads: opt.update(model, grads))
    for step in range(STEPS):
        grads = grad(model)
        d, ref_state = direction_update({"w": grads.l1.kernel[...].astype(jnp.float32)},
                                        ref_state)
        w = model.l1.kernel[...]
        update(opt, model, grads)
        assert model.l1.kernel[...].dtype == jnp.bfloat16
        assert_rounded_once(model.l1.kernel[...], w, d["w"], lr, wd, f"step {step}")


def test_the_check_catches_a_second_rounding():
    """The update rounded to bfloat16 before it is added (the rounding the library avoids)
    fails ``assert_rounded_once``, while the single rounding passes it."""
    rng = np.random.default_rng(SEED)
    w = rng.standard_normal(SHAPE).astype(ml_dtypes.bfloat16)
    d = rng.standard_normal(SHAPE).astype(np.float32)
    lr, wd = 0.03, 0.1
    w32 = w.astype(np.float32)
    update = (-lr * wd * w32 - lr * d).astype(np.float32)
    assert_rounded_once((w32 + update).astype(ml_dtypes.bfloat16), w, d, lr, wd, "once")
    twice = (w32 + update.astype(ml_dtypes.bfloat16).astype(np.float32)).astype(ml_dtypes.bfloat16)
    with pytest.raises(AssertionError, match="not the single rounding"):
        assert_rounded_once(twice, w, d, lr, wd, "twice")
