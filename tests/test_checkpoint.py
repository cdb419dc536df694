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
"""The optimizer state round-trips through orbax-checkpoint and training resumes identically.

On one device and on meshes of the 8 simulated CPU devices (tests/conftest.py): resuming from a
checkpoint is bitwise equal to the uninterrupted run; under compressed sync (``replica_axis``)
the momentum must be re-synchronized before saving, and then the restored run continues like the
fully synchronized one; a checkpoint saved on 8 devices restores onto 4 devices and onto 1.
Two processes saving one checkpoint: tests/test_multihost.py.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P, SingleDeviceSharding
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import dion3_jax
from platform_setup import committed

POLAR = dict(orthogonalizer=dion3_jax.make_orthogonalizer(method="standard",
                                                          compute_dtype=jnp.float32))


@pytest.mark.slow
def test_orbax_round_trip_and_resume(tmp_path):
    rng = np.random.default_rng(0)
    normal = lambda shape: rng.standard_normal(shape, np.float32)  # noqa: E731
    params = committed({"w": normal((16, 24)), "b": np.zeros((24,), np.float32),
                        "embed": normal((10, 16))})
    grads = [jax.tree.map(lambda x: jnp.asarray(normal(x.shape)), params) for _ in range(2)]
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


# ---------------------------------------------------------------------------------------------
# Meshes of the 8 simulated devices.

# (shape, spec over the FSDP axis "x"): every layout the distributed step knows, plus AdamW leaves.
LEAVES = {"rows": ((16, 64), P(None, "x")),     # output axis sharded (row selection per shard)
          "cols": ((32, 24), P("x", None)),     # reduction axis sharded
          "rep": ((12, 20), P()),               # replicated
          "b": ((24,), P()),                    # AdamW
          "embed": ((40, 16), P("x", None))}    # AdamW, sharded
STEPS, SAVE_AT = 4, 2                           # save after 2 steps, then 2 more


def need(n):
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} (simulated) devices")


def fsdp_mesh(n):
    return jax.make_mesh((n,), ("x",), axis_types=(AxisType.Explicit,),
                         devices=jax.devices()[:n])


def host_tree(seed, leaves=LEAVES):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, (s, _) in leaves.items()}


def place(tree, mesh, leaves=LEAVES):
    """On a mesh: each leaf with its spec; mesh None: on device 0."""
    return {k: jax.device_put(v, SingleDeviceSharding(jax.devices()[0]) if mesh is None
                              else NamedSharding(mesh, leaves[k][1]))
            for k, v in tree.items()}


def make_tx(**mesh_kw):
    return dion3_jax.dion3(0.05, 0.25, weight_decay=0.01, adam_learning_rate=0.01,
                           mesh_options=dion3_jax.MeshOptions(**mesh_kw), **POLAR)


def train(step, params, state, grads):
    for g in grads:
        updates, state = step(g, state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def save(path, tree):
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(path, tree)
    ckpt.wait_until_finished()
    return ckpt


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def max_error(a, b) -> float:
    """Largest |a - b| over the trees' leaves, relative to max(1, |b|)."""
    errs = jax.tree.map(lambda x, y: float(np.max(np.abs(np.asarray(x, np.float64) - y))
                                           / max(1.0, float(np.max(np.abs(y))))), a, b)
    return max(jax.tree.leaves(errs))


@pytest.mark.slow
def test_dion3_resume_on_8_device_mesh_is_bitwise(tmp_path):
    """dion3 on an FSDP mesh (8,): save after 2 steps, restore onto the shardings of a fresh
    ``tx.init``; steps 3 and 4 equal the uninterrupted run bitwise, state leaves included."""
    need(8)
    mesh = fsdp_mesh(8)
    grads = [host_tree(s + 1) for s in range(STEPS)]
    with jax.set_mesh(mesh):
        tx = make_tx()
        step = jax.jit(tx.update)
        params = place(host_tree(0), mesh)
        params, state = train(step, params, tx.init(params), [place(g, mesh)
                                                              for g in grads[:SAVE_AT]])
        ckpt = save(tmp_path / "ckpt", {"params": params, "opt": state})
        final = train(step, params, state, [place(g, mesh) for g in grads[SAVE_AT:]])

        fresh = place(host_tree(123), mesh)   # other values: only the layout is used
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct,
                              {"params": fresh, "opt": tx.init(fresh)})
        restored = ckpt.restore(tmp_path / "ckpt", target)
        jax.tree.map(lambda r, t: _assert_sharding(r, t.sharding), restored, target)
        assert_trees_equal(restored, {"params": params, "opt": state})
        resumed = train(step, restored["params"], restored["opt"],
                        [place(g, mesh) for g in grads[SAVE_AT:]])
    assert_trees_equal(resumed, final)
    assert max_error(final[0], params) > 1e-3          # the last steps did move the weights


def _assert_sharding(x, sharding):
    assert x.sharding == sharding, (x.sharding, sharding)


# Compressed sync over "dcn" on a (2, 4) mesh: per-replica gradients, update inside a shard_map.
SYNC_LEAVES = {"rows": ((16, 64), P(None, "fsdp")), "cols": ((32, 24), P("fsdp", None)),
               "rep": ((16, 24), P())}


def compressed_step(tx, mesh):
    """``tx.update`` inside a shard_map over "dcn": per-replica grads (leading axis), params and
    state replicated over "dcn"; returns the new params."""
    def step(g, state, params):
        u, state = tx.update(jax.tree.map(lambda x: x[0], g), state, params)
        return optax.apply_updates(params, u), state
    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("dcn"), P(), P()),
                                 out_specs=(P(), P()), axis_names={"dcn"}, check_vma=False))


@pytest.mark.slow
def test_replica_axis_resynchronize_before_save(tmp_path):
    """After 2 compressed steps the pods' momenta differ; saved as is, the checkpoint holds one
    pod's copy, not the mean (measured relative difference 1.0 from the synchronized momentum).
    ``synchronize_momentum`` then save: the restored momentum and params are the fully
    synchronized run's (mean gradient; measured 7.8e-8 and 9.5e-8), and 2 more compressed steps
    from the restored state equal those from the in-memory synchronized state bitwise and the
    fully synchronized run's within float rounding (measured 9.5e-8 params, 1.8e-7 momentum;
    all asserted < 1e-5)."""
    need(8)
    mesh = jax.make_mesh((2, 4), ("dcn", "fsdp"), axis_types=(AxisType.Explicit,) * 2)
    rng = np.random.default_rng(7)
    per_pod = [{k: rng.standard_normal((2,) + s).astype(np.float32)
                for k, (s, _) in SYNC_LEAVES.items()} for _ in range(STEPS)]

    def put(tree, stacked=False):
        return {k: jax.device_put(v, NamedSharding(mesh, P("dcn", *SYNC_LEAVES[k][1]) if stacked
                                                   else SYNC_LEAVES[k][1]))
                for k, v in tree.items()}

    with jax.set_mesh(mesh):
        tx = make_tx(replica_axis="dcn", replica_selection="random", seed=1)
        comp, sync = compressed_step(tx, mesh), jax.jit(tx.update)
        params = put(host_tree(0, SYNC_LEAVES))
        c_params, c_state = params, tx.init(params)
        s_params, s_state = params, c_state
        for g in per_pod[:SAVE_AT]:
            c_params, c_state = comp(put(g, stacked=True), c_state, c_params)
            s_params, s_state = train(sync, s_params, s_state,
                                      [put(jax.tree.map(lambda x: x.mean(0), g))])
        momentum = lambda s: s.inner_states["dion3"].inner_state[0].full_momentum()  # noqa: E731

        # Saved without synchronizing: one pod's momentum, which is not the synchronized one.
        unsynced = save(tmp_path / "unsynced", {"params": c_params, "opt": c_state}).restore(
            tmp_path / "unsynced", jax.tree.map(ocp.utils.to_shape_dtype_struct,
                                                {"params": c_params, "opt": c_state}))
        assert max_error(momentum(unsynced["opt"]), momentum(s_state)) > 1e-2

        c_state = dion3_jax.synchronize_momentum(c_state, "dcn")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct,
                                {"params": c_params, "opt": c_state})
        restored = save(tmp_path / "synced", {"params": c_params, "opt": c_state}).restore(
            tmp_path / "synced", abstract)
        assert max_error(momentum(restored["opt"]), momentum(s_state)) < 1e-5
        assert max_error(restored["params"], s_params) < 1e-5

        def more(step_params, state):
            for g in per_pod[SAVE_AT:]:
                step_params, state = comp(put(g, stacked=True), state, step_params)
            return step_params, dion3_jax.synchronize_momentum(state, "dcn")
        resumed = more(restored["params"], restored["opt"])
        uninterrupted = more(c_params, c_state)
        s_final = train(sync, s_params, s_state,
                        [put(jax.tree.map(lambda x: x.mean(0), g)) for g in per_pod[SAVE_AT:]])
    assert_trees_equal(resumed, uninterrupted)
    assert max_error(resumed[0], s_final[0]) < 1e-5
    assert max_error(momentum(resumed[1]), momentum(s_final[1])) < 1e-5


@pytest.fixture(scope="module")
def saved_on_8(tmp_path_factory):
    """The 8-device run of the test below, once for both device counts (adjacent: one xdist
    worker runs both): the checkpoint's path, what it holds (after 2 steps) and the state after
    2 more steps on the 8 devices."""
    need(8)
    mesh8 = fsdp_mesh(8)
    grads = [host_tree(s + 1) for s in range(STEPS)]
    tx = make_tx(selection_scope="global")
    path = tmp_path_factory.mktemp("ckpt8") / "ckpt"
    with jax.set_mesh(mesh8):
        step = jax.jit(tx.update)
        params = place(host_tree(0), mesh8)
        params, state = train(step, params, tx.init(params), [place(g, mesh8)
                                                              for g in grads[:SAVE_AT]])
        saved = {"params": params, "opt": state}
        save(path, saved).close()
        final8 = train(step, params, state, [place(g, mesh8) for g in grads[SAVE_AT:]])
    return path, saved, final8


@pytest.mark.slow
@pytest.mark.parametrize("devices", [4, 1])
def test_checkpoint_from_8_devices_restores_onto_fewer(saved_on_8, devices):
    """Saved on the FSDP mesh (8,), restored with ``jax.ShapeDtypeStruct(..., sharding=...)``
    onto the mesh (4,) (same specs) or onto one device: the restored arrays are bitwise the saved
    ones, and 2 more steps there match the 8-device continuation. ``selection_scope="global"``
    makes the algorithm independent of the mesh (with "local" the row-sharded matrices select per
    shard, so another mesh is another optimizer); what remains is float rounding of the other
    assembly/padding and reduction order: measured max relative difference 1.9e-8 (4 devices)
    and 6.1e-8 (1 device) over params and state after 2 steps, asserted < 1e-5 (with "local"
    scope the same check measures 0.05 and 0.043 and fails)."""
    path, saved, final8 = saved_on_8
    grads = [host_tree(s + 1) for s in range(STEPS)]
    tx = make_tx(selection_scope="global")
    mesh = fsdp_mesh(devices) if devices > 1 else None
    one = SingleDeviceSharding(jax.devices()[0])

    def retarget(x):
        sharding = one if mesh is None else NamedSharding(mesh, x.sharding.spec)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    target = jax.tree.map(retarget, saved)
    restored = ocp.StandardCheckpointer().restore(path, target)
    jax.tree.map(lambda r, t: _assert_sharding(r, t.sharding), restored, target)
    assert all(len(x.sharding.device_set) == devices for x in jax.tree.leaves(restored))
    assert_trees_equal(restored, saved)

    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        step = jax.jit(tx.update)
        final = train(step, restored["params"], restored["opt"],
                      [place(g, mesh) for g in grads[SAVE_AT:]])
    assert all(len(x.sharding.device_set) == devices for x in jax.tree.leaves(final))
    # (Which groups defer their rows' decay depends on the mesh: the momenta compare folded.)
    err = max_error(dion3_jax.fold_momentum_scale(final), dion3_jax.fold_momentum_scale(final8))
    print(f"8 -> {devices} devices: max relative difference after 2 steps {err:.2g}")
    assert err < 1e-5
    assert max_error(final8[0], saved["params"]) > 1e-3

