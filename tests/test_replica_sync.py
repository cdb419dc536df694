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
"""Compressed DCN data-parallel sync on a 2 × 4 ("dcn", "fsdp") mesh of simulated CPU devices.

Each replica passes its own gradient (update called inside a shard_map over "dcn"); only the
selected rows are averaged across replicas. With replica_selection="random" the update equals the
fully synchronized one (gradients averaged first), and after synchronize_momentum so does the
momentum. The bytes all-reduced over "dcn" scale with f.

With ``DION3_TEST_PLATFORM=gpu`` (any ``jax.devices`` platform name) the mesh is (2, N/2) over
that platform's N devices, N even ((2, 1) on two GPUs: compressed sync across the two), at
"highest" float32 matmul precision (scripts/gpu_multi.sh).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import numpy as np
import pytest

import dion3_jax
from platform_setup import DEVICES, PLATFORM

if PLATFORM:
    pytestmark = [pytest.mark.skipif(len(DEVICES) < 2 or len(DEVICES) % 2,
                                     reason=f"needs an even number of {PLATFORM} devices")]
    FSDP = len(DEVICES) // 2
else:
    pytestmark = [pytest.mark.skipif(len(DEVICES) < 8, reason="needs 8 (simulated) devices")]
    FSDP = 4
pytestmark.append(pytest.mark.usefixtures("on_test_platform"))

POLAR = dict(orthogonalizer=dion3_jax.make_orthogonalizer(method="standard",
                                                          compute_dtype=jnp.float32))
MO = dion3_jax.MeshOptions
SPECS = {"rows": ((16, 64), P(None, "fsdp")),     # output axis sharded
         "cols": ((32, 24), P("fsdp", None)),     # reduction axis sharded
         "rep": ((16, 24), P())}                   # replicated


def mesh(axis_type=AxisType.Explicit):
    types = (axis_type, axis_type)
    if not PLATFORM:
        return jax.make_mesh((2, 4), ("dcn", "fsdp"), axis_types=types)
    return jax.make_mesh((2, FSDP), ("dcn", "fsdp"), devices=DEVICES[:2 * FSDP], axis_types=types)


def trees(seed, replicas=None):
    rng = np.random.default_rng(seed)
    lead = () if replicas is None else (replicas,)
    return {k: rng.standard_normal(lead + s).astype(np.float32) for k, (s, _) in SPECS.items()}


def put(tree, m, stacked=False):
    return {k: jax.device_put(v, NamedSharding(m, P("dcn", *SPECS[k][1]) if stacked
                                               else SPECS[k][1])) for k, v in tree.items()}


def compressed_update(tx, m):
    """update inside a shard_map over "dcn": per-replica grads in, per-replica updates out."""
    def step(g, state):
        u, state = tx.update(jax.tree.map(lambda x: x[0], g), state)
        return jax.tree.map(lambda x: x[None], u), state
    return jax.jit(jax.shard_map(step, mesh=m, in_specs=(P("dcn"), P()),
                                 out_specs=(P("dcn"), P()), axis_names={"dcn"},
                                 check_vma=False))


@functools.cache
def _compressed(fraction: float, mesh_options: MO):
    """``scale_by_dion3(fraction, mesh_options=mesh_options, **POLAR)`` and its compressed
    update on the Explicit mesh: one compile per configuration, shared by the tests that run
    the same one (``mesh_options`` without ``param_specs``, so that it can be a key)."""
    tx = dion3_jax.scale_by_dion3(fraction, mesh_options=mesh_options, **POLAR)
    return tx, compressed_update(tx, mesh())


@pytest.mark.slow
@pytest.mark.parametrize("scope,axis_type", [("local", AxisType.Explicit),
                                              ("global", AxisType.Explicit),
                                              ("local", AxisType.Auto)])
def test_random_compressed_sync_equals_fully_synchronized(scope, axis_type):
    """Under Auto axes the leaves' specs come from ``param_specs``."""
    m = mesh(axis_type)
    specs = ({k: spec for k, (_, spec) in SPECS.items()} if axis_type == AxisType.Auto
             else None)
    mo = MO(replica_axis="dcn", replica_selection="random", selection_scope=scope, seed=3,
            param_specs=specs)
    params = trees(0)
    grads = [trees(s + 1, replicas=2) for s in range(3)]
    with jax.set_mesh(m):
        if specs is None:
            tx, comp_update = _compressed(0.25, mo)
        else:
            tx = dion3_jax.scale_by_dion3(0.25, mesh_options=mo, **POLAR)
            comp_update = compressed_update(tx, m)
        s_sync = s_comp = tx.init(put(params, m))
        types = jax.tree.map(jax.typeof, s_comp)
        sync_update = jax.jit(tx.update)
        for g in grads:
            u_sync, s_sync = sync_update(put(jax.tree.map(lambda x: x.mean(0), g), m), s_sync)
            u_comp, s_comp = comp_update(put(g, m, stacked=True), s_comp)
            for k in SPECS:
                both = np.asarray(u_comp[k])
                np.testing.assert_array_equal(both[0], both[1])   # replicas stay identical
                np.testing.assert_allclose(both[0], np.asarray(u_sync[k]), atol=2e-5,
                                           err_msg=k)
        assert jax.tree.map(jax.typeof, s_comp) == types
        synced = dion3_jax.synchronize_momentum(s_comp, "dcn")
        for k in SPECS:
            np.testing.assert_allclose(np.asarray(synced.full_momentum()[k]),
                                       np.asarray(s_sync.full_momentum()[k]), atol=2e-5,
                                       err_msg=k)
        assert jax.tree.map(jax.typeof, synced) == types


@pytest.mark.slow
def test_norms_selection_keeps_replicas_identical():
    m = mesh()
    params = trees(0)
    g = trees(1, replicas=2)
    with jax.set_mesh(m):
        tx = dion3_jax.scale_by_dion3(
            0.25, mesh_options=MO(replica_axis="dcn", replica_selection="norms"), **POLAR)
        state = tx.init(put(params, m))
        u, _ = compressed_update(tx, m)(put(g, m, stacked=True), state)
    for k in SPECS:
        both = np.asarray(u[k])
        np.testing.assert_array_equal(both[0], both[1])
        assert np.count_nonzero(both[0]) > 0


def dcn_all_reduce_by_dtype(hlo: str) -> dict[str, int]:
    """Elements all-reduced over "dcn" per dtype (payload averages and per-matrix scales)."""
    total: dict[str, int] = {}
    for line in hlo.splitlines():
        m = re.search(r"= (.*) all-reduce(?:-start)?\(", line)
        if m and re.search(r"replica_groups=.*\{'dcn'\}", line):
            for dtype, dims in re.findall(r"([a-z]+[0-9]*)\[([0-9,]*)\]", m.group(1)):
                n = int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
                total[dtype] = total.get(dtype, 0) + n
    return total


def dcn_all_reduce_elements(hlo: str) -> int:
    return sum(dcn_all_reduce_by_dtype(hlo).values())


@pytest.mark.slow
def test_bytes_over_replica_axis_scale_with_fraction():
    m = mesh()
    params = trees(0)
    g = trees(1, replicas=2)
    sizes = {}
    for f in (1.0, 0.125):   # (each fraction compiles the step: two are enough for the law)
        with jax.set_mesh(m):
            tx = dion3_jax.scale_by_dion3(f, mesh_options=MO(replica_axis="dcn"))
            state = tx.init(put(params, m))
            hlo = compressed_update(tx, m).lower(put(g, m, stacked=True), state).compile(
                ).as_text()
        sizes[f] = dcn_all_reduce_elements(hlo)
    # Only the selected rows cross "dcn": (k rows) × (local columns) per matrix —
    # rows: 64/4 = 16 local rows of 16 columns; cols: 24 rows of 32/4 columns; rep: 24 rows of 16
    # (FSDP = 4 on the CPU).
    expect = {f: sum(cols * max(1, int(np.ceil(f * n)))
                     for n, cols in ((64 // FSDP, 16), (24, 32 // FSDP), (24, 16)))
              for f in sizes}
    assert sizes == expect, (sizes, expect)
    assert sizes[1.0] / sizes[0.125] > 7


@pytest.mark.slow
def test_float16_replica_wire_sends_16_bits_and_stays_within_its_rounding():
    """``replica_wire_dtype=float16``: the averaged rows cross "dcn" in float16 (only one float32
    scale per matrix besides), the replicas stay identical, and the update moves from the
    float32 wire's by float16 rounding (not more, and not zero: the wire is really 16-bit)."""
    m = mesh()
    params = trees(0)
    grads = [trees(s + 1, replicas=2) for s in range(3)]
    with jax.set_mesh(m):
        (tx16, up16), (_, up32) = (_compressed(0.25, MO(replica_axis="dcn", seed=3,
                                                        replica_wire_dtype=wire))
                                   for wire in (jnp.float16, None))
        s16 = s32 = tx16.init(put(params, m))
        sizes = {w: dcn_all_reduce_by_dtype(up.lower(put(grads[0], m, stacked=True), s16)
                                            .compile().as_text())
                 for w, up in (("16", up16), ("32", up32))}
        for g in grads:
            u16, s16 = up16(put(g, m, stacked=True), s16)
            u32, s32 = up32(put(g, m, stacked=True), s32)
            for k in SPECS:
                a, b = np.asarray(u16[k]), np.asarray(u32[k])
                np.testing.assert_array_equal(a[0], a[1])
                err = np.linalg.norm(a[0] - b[0]) / np.linalg.norm(b[0])
                assert 0 < err < 3e-3, (k, err)
    payload = sizes["32"]["f32"]
    assert "f16" not in sizes["32"]
    assert sizes["16"]["f16"] == payload  # the same rows, half the bytes
    assert sizes["16"].get("f32", 0) <= len(SPECS)  # one scale per matrix


@pytest.mark.skipif(PLATFORM is not None, reason="a 1 × 8 mesh of the simulated CPU devices")
# The fast loop: norms selection on the float16 wire; random selection with the slow tests.
@pytest.mark.parametrize("selection,wire", [pytest.param("random", None, marks=pytest.mark.slow),
                                            ("norms", "float16")])
def test_one_pod_compiles_and_equals_the_plain_step(selection, wire):
    """A (1, 8) ("dcn", "fsdp") mesh: compressed sync over a replica axis of size 1 (one pod)
    compiles (XLA refuses an all-reduce over a manual axis of size 1, so the library leaves
    such axes out of its collectives) and gives the plain step's update; synchronize_momentum
    leaves the one replica's momentum as it is."""
    m = jax.make_mesh((1, 8), ("dcn", "fsdp"), axis_types=(AxisType.Explicit,) * 2)
    kw = dict(mesh_options=MO(replica_axis="dcn", replica_selection=selection, seed=3,
                              replica_wire_dtype=wire), **POLAR)
    params, g = trees(0), trees(1, replicas=1)
    with jax.set_mesh(m):
        tx = dion3_jax.scale_by_dion3(0.25, **kw)
        state = tx.init(put(params, m))
        u_plain, s_plain = jax.jit(tx.update)(put(jax.tree.map(lambda x: x[0], g), m), state)
        u, s = compressed_update(tx, m)(put(g, m, stacked=True), state)
        synced = dion3_jax.synchronize_momentum(s, "dcn")
    for k in SPECS:
        np.testing.assert_allclose(np.asarray(u[k])[0], np.asarray(u_plain[k]), atol=1e-5,
                                   err_msg=k)
        np.testing.assert_array_equal(np.asarray(synced.full_momentum()[k]),
                                      np.asarray(s.full_momentum()[k]), err_msg=k)


def test_synchronize_momentum_validation():
    with pytest.raises(ValueError, match="replica_axis"):
        dion3_jax.synchronize_momentum({}, "dcn")
