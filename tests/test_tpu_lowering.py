"""The whole default step lowers for TPU from the CPU (cross-platform lowering; nothing runs on
a TPU), with no GPU kernel in the module. The kernel choices resolve on the CPU's default device
here; an 8-device mesh case and a check of ``"auto"`` on a TPU target are still to come."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import dion3_jax

SHAPES = {"q": (64, 64), "up": (64, 176), "down": (176, 64), "b": (64,)}


@pytest.mark.parametrize("fraction", [1.0, 0.25])
def test_the_step_lowers_for_tpu_on_one_device(fraction):
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
    tx = dion3_jax.dion3(0.02, fraction)
    state = jax.eval_shape(tx.init, params)
    text = jax.jit(tx.update).trace(params, state, params).lower(
        lowering_platforms=("tpu",)).as_text()
    assert "dot_general" in text
    assert "triton" not in text and "mosaic_gpu" not in text
