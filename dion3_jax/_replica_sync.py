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
"""Compressed data-parallel sync across replicas (e.g. pods over the data-center network, "dcn").

With ``replica_axis`` given and ``update`` called inside a ``jax.shard_map`` that makes that axis
manual, every replica passes its own, un-averaged gradient. Each replica keeps its own momentum
``M_r``; the row set ``I`` is chosen identically on every replica without first averaging ``M``:

``"random"``
  ``I`` = top-k of uniform scores drawn from a key shared by all replicas (derived from ``seed``,
  the step count and the matrix), so the update equals the fully synchronized one exactly
  (``mean_r M_r[I] = (mean_r M_r)[I]``).
``"norms"``
  only the ``n`` row ℓ1 norms of each matrix are summed over the replicas (``Σ_r ‖M_r[i]‖₁``, an
  approximation of ``‖Σ_r M_r[i]‖₁``) and ``I`` is their top-k.

Then only ``M_r[I, :]`` (``k × C`` instead of ``n × C``: a ``1/f`` saving) is averaged over the
replica axis, orthogonalized, and written back decayed: ``M_r[I] ← μ · mean_r M_r[I]``. The mean of
the replicas' momenta therefore follows the synchronized recursion exactly; the unselected rows
drift apart until they are selected. :func:`synchronize_momentum` averages them (call it before
saving a checkpoint).
"""

from __future__ import annotations

import jax

from dion3_jax._collectives import nontrivial
from dion3_jax._transform import ScaleByDion3State
from dion3_jax._types import AnyMesh, OptState


def _pmean_momentum(opt_state: OptState, replica_axis: str) -> OptState:
    def fix(node):
        if isinstance(node, ScaleByDion3State):
            node = node.folded()
            if not nontrivial((replica_axis,)):    # one replica: already its own mean
                return node
            return node._replace(momentum=jax.tree.map(
                lambda m: jax.lax.pmean(m, replica_axis), node.momentum))
        return node
    return jax.tree.map(fix, opt_state, is_leaf=lambda x: isinstance(x, ScaleByDion3State))


def synchronize_momentum(opt_state: OptState, replica_axis: str = "dcn", *,
                         mesh: AnyMesh | None = None) -> OptState:
    """Averages every Dion3 momentum over the replica axis (call before saving a checkpoint).

    After compressed sync (``replica_axis`` set and ``update`` called inside a shard_map over it)
    the replicas' momenta differ in their unselected rows; the arrays are still declared
    replicated over the replica axis, so a checkpoint would save one replica's copy. This makes
    every replica hold ``mean_r M_r`` (the momentum of the fully synchronized run under
    ``replica_selection="random"``); weights and second moments are identical already.

    Args:
      opt_state: an optimizer state containing :class:`dion3_jax.ScaleByDion3State` nodes (from
        ``scale_by_dion3`` or ``dion3`` / ``muon`` / ``normuon``).
      replica_axis: the replica mesh axis.
      mesh: the mesh; default: the ambient one (``jax.set_mesh``). Ignored when the replica axis
        is already manual (called inside a shard_map over it).

    Returns:
      The state with synchronized momenta (same shardings).

    Examples:
      >>> # state = synchronize_momentum(state, "dcn")   # then save the checkpoint
    """
    ambient = jax.sharding.get_abstract_mesh()
    if not ambient.empty and replica_axis in ambient.manual_axes:
        return _pmean_momentum(opt_state, replica_axis)
    if mesh is None:
        mesh = None if ambient.empty else ambient
    if mesh is None or replica_axis not in mesh.axis_names:
        raise ValueError(f"replica_axis={replica_axis!r} is not an axis of the mesh "
                         f"({None if mesh is None else mesh.axis_names}); pass mesh=")
    fn = jax.shard_map(lambda s: _pmean_momentum(s, replica_axis), mesh=mesh,
                       in_specs=jax.P(), out_specs=jax.P(), axis_names={replica_axis},
                       check_vma=False)
    return jax.jit(fn)(opt_state)
