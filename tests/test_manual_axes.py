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
"""``update`` called inside a user's ``jax.shard_map``: the global update or a ValueError.

Inside a shard_map each device sees its shard of a leaf sharded over a manual axis, and the step
would orthogonalize that shard as if it were the whole matrix (per-shard updates, no error).
Only the replica axis may be manual (compressed sync, tests/test_replica_sync.py); any other
manual axis of size > 1 raises a ValueError saying how to call ``update``; a manual axis of size
1 has no shards, and the update is the global one. On the 8 simulated CPU devices
(tests/conftest.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import numpy as np
import pytest

import dion3_jax

SEED = 4417
POLAR = dict(orthogonalizer=dion3_jax.make_orthogonalizer(method="standard",
                                                          compute_dtype=jnp.float32))
SPECS = {"rows": ((16, 32), P(None, "tp")), "cols": ((32, 16), P("tp", None)),
         "rep": ((16, 24), P())}

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")


def make_mesh(fsdp, tp):
    return jax.make_mesh((fsdp, tp), ("fsdp", "tp"), devices=jax.devices()[:fsdp * tp],
                         axis_types=(AxisType.Explicit,) * 2)


def placed(mesh, seed):
    rng = np.random.default_rng(seed)
    return {k: jax.device_put(rng.standard_normal(s).astype(np.float32), NamedSharding(mesh, p))
            for k, (s, p) in SPECS.items()}


def inside_shard_map(tx, mesh, state):
    """``tx.update`` inside a shard_map that makes "tp" manual (leaves in their specs)."""
    specs = {k: p for k, (_, p) in SPECS.items()}
    state_specs = jax.tree.map(lambda x: x.sharding.spec, state)
    return jax.jit(jax.shard_map(tx.update, mesh=mesh, in_specs=(specs, state_specs),
                                 out_specs=(specs, state_specs), axis_names={"tp"},
                                 check_vma=False))


def test_update_inside_a_shard_map_over_a_sharded_axis_raises():
    """On a (4, 2) ("fsdp", "tp") mesh, "tp" manual: the ValueError names the axis and both
    ways to call ``update``; the state is left as it was."""
    mesh = make_mesh(4, 2)
    with jax.set_mesh(mesh):
        tx = dion3_jax.scale_by_dion3(0.25, **POLAR)
        state = tx.init(placed(mesh, SEED))
        before = jax.tree.map(np.asarray, state)
        with pytest.raises(ValueError, match=r"\('tp',\) manual") as info:
            inside_shard_map(tx, mesh, state)(placed(mesh, SEED + 1), state)
    assert "outside that shard_map" in str(info.value)
    assert "MeshOptions(replica_axis='tp')" in str(info.value)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state), before)


def test_init_inside_a_shard_map_over_a_sharded_axis_raises():
    mesh = make_mesh(4, 2)
    tx = dion3_jax.scale_by_dion3(0.25, **POLAR)
    specs = {k: p for k, (_, p) in SPECS.items()}
    init = jax.shard_map(tx.init, mesh=mesh, in_specs=(specs,), out_specs=P(),
                         axis_names={"tp"}, check_vma=False)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="replica_axis='tp'"):
        jax.eval_shape(init, placed(mesh, SEED))


@pytest.mark.slow
def test_manual_axis_of_size_one_gives_the_global_update():
    """On an (8, 1) mesh, "tp" manual has one shard: the update inside the shard_map equals
    the one under plain jit to float32 rounding (the two programs assemble the rows-sharded leaf
    differently: measured 1.9e-6, asserted < 1e-5)."""
    mesh = make_mesh(8, 1)
    with jax.set_mesh(mesh):
        tx = dion3_jax.scale_by_dion3(0.25, **POLAR)
        state = tx.init(placed(mesh, SEED))
        grads = placed(mesh, SEED + 1)
        want, _ = jax.jit(tx.update)(grads, state)
        got, _ = inside_shard_map(tx, mesh, state)(grads, state)
    for k in SPECS:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), atol=1e-5,
                                   err_msg=k)
