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
"""Resuming compressed sync under ``replica_selection="norms"`` from an orbax checkpoint.

Under compressed sync each replica keeps its own momentum in arrays declared replicated over the
replica axis. With "norms" the next row set depends on each replica's momentum (the sum of
their row ℓ1 norms), so the replicas' mean (``synchronize_momentum``) does not continue the
run; ``stack_replica_momenta`` checkpoints every replica's momentum and
``unstack_replica_momenta`` hands each its own back: the restored run's updates equal the
uninterrupted run's bitwise. On one device (or a replica axis of another size) there is no
replica to hand each momentum to: ``unstack_replica_momenta`` raises a ValueError saying what to
do, and ``average=True`` gives the mean. On a (2, 4) ("dcn", "fsdp") mesh of the 8 simulated CPU
devices (tests/conftest.py).
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P, SingleDeviceSharding
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import dion3_jax
from test_checkpoint import assert_trees_equal, make_tx, max_error, save

SEED = 3029
LEAVES = {"rows": ((16, 64), P(None, "fsdp")), "cols": ((32, 24), P("fsdp", None)),
          "rep": ((16, 24), P())}
STEPS, SAVE_AT = 4, 2

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")


def make_mesh(dcn, fsdp):
    return jax.make_mesh((dcn, fsdp), ("dcn", "fsdp"), devices=jax.devices()[:dcn * fsdp],
                         axis_types=(AxisType.Explicit,) * 2)


def put(tree, mesh, stacked=False):
    return {k: jax.device_put(v, NamedSharding(mesh, P("dcn", *LEAVES[k][1]) if stacked
                                               else LEAVES[k][1])) for k, v in tree.items()}


def trees(seed, replicas=None):
    rng = np.random.default_rng(seed)
    lead = () if replicas is None else (replicas,)
    return {k: rng.standard_normal(lead + s).astype(np.float32) for k, (s, _) in LEAVES.items()}


def compressed_step(tx, mesh):
    """``tx.update`` inside a shard_map over "dcn" on per-replica gradients (leading axis):
    (updates, params, state) after one step; updates and params are the same on every pod."""
    def step(g, state, params):
        u, state = tx.update(jax.tree.map(lambda x: x[0], g), state, params)
        return u, optax.apply_updates(params, u), state
    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("dcn"), P(), P()),
                                 out_specs=(P(), P(), P()), axis_names={"dcn"},
                                 check_vma=False))


def run(step, mesh, params, state, grads):
    """The steps' updates, and the params and state after them."""
    updates = []
    for g in grads:
        u, params, state = step(put(g, mesh, stacked=True), state, params)
        updates.append(u)
    return updates, params, state


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """2 compressed "norms" steps on (2, 4), saved with every replica's momentum; then the
    uninterrupted run's next 2 updates and state (its momenta stacked, to compare them all)."""
    mesh = make_mesh(2, 4)
    grads = [trees(SEED + 1 + s, replicas=2) for s in range(STEPS)]
    path = tmp_path_factory.mktemp("norms") / "ckpt"
    with jax.set_mesh(mesh):
        tx = make_tx(replica_axis="dcn", replica_selection="norms")
        step = compressed_step(tx, mesh)
        _, params, state = run(step, mesh, put(trees(SEED), mesh),
                               tx.init(put(trees(SEED), mesh)), grads[:SAVE_AT])
        stacked = dion3_jax.stack_replica_momenta(state, "dcn")
        save(path, {"params": params, "opt": stacked}).close()
        updates, _, final = run(step, mesh, params, state, grads[SAVE_AT:])
        final = dion3_jax.stack_replica_momenta(final, "dcn")
        synced = run(step, mesh, params, dion3_jax.synchronize_momentum(state, "dcn"),
                     grads[SAVE_AT:SAVE_AT + 1])[0]
    return dict(path=path, params=params, stacked=stacked, grads=grads, updates=updates,
                final=final, synced=synced)


@pytest.mark.slow
def test_norms_resume_on_the_same_mesh_is_bitwise(saved):
    """Restored onto the shardings of a fresh ``stack_replica_momenta(tx.init(params))`` on
    (2, 4): both replicas' momenta come back, and the next 2 updates and the final state
    (every replica's momentum) equal the uninterrupted run's bitwise. Continuing from
    ``synchronize_momentum``'s mean instead changes the next update (the row selection differs:
    measured 1.2, the largest relative Frobenius error over the leaves; asserted > 0.1)."""
    mesh = make_mesh(2, 4)
    with jax.set_mesh(mesh):
        tx = make_tx(replica_axis="dcn", replica_selection="norms")
        fresh = put(trees(SEED + 99), mesh)      # other values: only the layout is used
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, {
            "params": fresh, "opt": dion3_jax.stack_replica_momenta(tx.init(fresh), "dcn")})
        restored = ocp.StandardCheckpointer().restore(saved["path"], target)
        jax.tree.map(lambda r, t: np.testing.assert_equal(r.sharding, t.sharding), restored,
                     target)
        assert_trees_equal(restored["opt"], saved["stacked"])
        state = dion3_jax.unstack_replica_momenta(restored["opt"], "dcn")
        updates, _, final = run(compressed_step(tx, mesh), mesh, restored["params"], state,
                                saved["grads"][SAVE_AT:])
        final = dion3_jax.stack_replica_momenta(final, "dcn")
    assert_trees_equal(updates, saved["updates"])
    assert_trees_equal(final, saved["final"])
    rows = np.asarray(saved["final"].inner_states["dion3"].inner_state[0].momentum["rows"])
    assert max_error(rows[0], rows[1]) > 1e-2       # the two replicas' momenta differ
    err = max(np.linalg.norm(np.asarray(a) - b) / np.linalg.norm(b) for a, b in zip(
        jax.tree.leaves(saved["synced"][0]), jax.tree.leaves(saved["updates"][0])))
    print(f"next update from the replicas' mean momentum: {err:.2g} relative")
    assert err > 0.1


@pytest.mark.slow
def test_norms_checkpoint_on_one_device_says_what_to_do(saved):
    """Restored onto one device: ``unstack_replica_momenta`` refuses (no replica axis to hand
    each momentum to) and names both ways on; so does a mesh whose "dcn" has 4 devices.
    ``average=True`` gives the replicas' mean, ``synchronize_momentum``'s on the mesh (< 1e-6),
    from which a single-device tx continues."""
    one = SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one),
                          {"params": saved["params"], "opt": saved["stacked"]})
    restored = ocp.StandardCheckpointer().restore(saved["path"], target)
    assert_trees_equal(restored["opt"], saved["stacked"])
    with pytest.raises(ValueError, match="2 replicas' momenta") as info:
        dion3_jax.unstack_replica_momenta(restored["opt"], "dcn")
    assert "average=True" in str(info.value) and "'dcn' axis has 2 devices" in str(info.value)
    with jax.set_mesh(make_mesh(4, 2)), pytest.raises(ValueError, match="has 4 devices"):
        dion3_jax.unstack_replica_momenta(restored["opt"], "dcn")

    state = dion3_jax.unstack_replica_momenta(restored["opt"], "dcn", average=True)
    with jax.set_mesh(make_mesh(2, 4)):
        mean = dion3_jax.synchronize_momentum(
            dion3_jax.unstack_replica_momenta(saved["stacked"], "dcn"), "dcn")
    dion3 = lambda s: s.inner_states["dion3"].inner_state[0]  # noqa: E731
    assert max_error(dion3(state).full_momentum(), dion3(mean).full_momentum()) < 1e-6
    tx = make_tx()
    grads = jax.tree.map(lambda x: x.mean(0), saved["grads"][SAVE_AT])
    updates, _ = jax.jit(tx.update)(grads, state, restored["params"])
    assert all(np.isfinite(np.asarray(u)).all() for u in jax.tree.leaves(updates))


def test_stack_needs_the_replica_axis_and_unstack_a_stacked_state():
    tx = dion3_jax.scale_by_dion3(0.25)
    state = tx.init({"w": np.zeros((4, 8), np.float32)})
    with pytest.raises(ValueError, match="replica_axis='dcn'"):
        dion3_jax.stack_replica_momenta(state, "dcn")
    with pytest.raises(ValueError, match=r"momentum\['w'\] has shape \(4, 8\).*not stacked"):
        dion3_jax.unstack_replica_momenta(state, "dcn", average=True)
