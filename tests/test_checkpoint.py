"""The optimizer state round-trips through orbax-checkpoint and training resumes identically."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import dion3_jax


def test_orbax_round_trip_and_resume(tmp_path):
    k = jax.random.split(jax.random.key(0), 4)
    params = {"w": jax.random.normal(k[0], (16, 24)), "b": jnp.zeros((24,)),
              "embed": jax.random.normal(k[1], (10, 16))}
    grads = [jax.tree.map(lambda x, kk=kk: jax.random.normal(kk, x.shape), params)
             for kk in k[2:]]
    tx = dion3_jax.dion3(0.02, 0.5)
    step = jax.jit(tx.update)
    state = tx.init(params)
    upd, state = step(grads[0], state, params)
    params = optax.apply_updates(params, upd)

    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "state", {"params": params, "opt": state})
    ckpt.wait_until_finished()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt": state})
    restored = ckpt.restore(tmp_path / "state", abstract)

    assert jax.tree.structure(restored["opt"]) == jax.tree.structure(state)
    u_a, _ = step(grads[1], state, params)
    u_b, _ = step(grads[1], restored["opt"], restored["params"])
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 u_a, u_b)
