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
drift apart until they are selected. The arrays are declared replicated over the replica axis, so
a checkpoint of the state as it is holds one replica's momentum. Two ways to save:

* :func:`synchronize_momentum` averages the replicas' momenta. Under ``"random"`` every update
  depends on the momenta only through their mean, and the run continues exactly (on a mesh
  with the replica axis).
* :func:`stack_replica_momenta` stacks them along a new leading axis sharded over the replica
  axis, and :func:`unstack_replica_momenta` hands each replica its own back. Under ``"norms"``
  the next row set depends on each replica's momentum (``Σ_r ‖M_r[i]‖₁``), not on their mean:
  this is the checkpoint from which the run continues exactly (from the mean, the next update
  moved by 1.2 relative in ``tests/test_resume.py``). Only a mesh whose replica axis has as many
  devices runs it; elsewhere (one device, another replica count) the replicas' mean is what there
  is (``unstack_replica_momenta(..., average=True)``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

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
    ``replica_selection="random"``); weights and second moments are identical already. Under
    ``replica_selection="norms"`` the next row set depends on each replica's own momentum, so a
    run continued from the mean is not the uninterrupted run: checkpoint
    :func:`stack_replica_momenta` instead.

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


def _is_node(x) -> bool:
    return isinstance(x, ScaleByDion3State)


def _map_momentum(opt_state: OptState, fn) -> OptState:
    """``fn`` applied to every Dion3 momentum leaf of ``opt_state``."""
    return jax.tree.map(lambda x: x._replace(momentum=jax.tree.map(fn, x.momentum))
                        if _is_node(x) else x, opt_state, is_leaf=_is_node)


def _specs(opt_state: OptState, momentum_spec: P):
    """``momentum_spec`` for every Dion3 momentum leaf, ``P()`` for every other leaf."""
    def spec(x):
        if not _is_node(x):
            return P()
        return jax.tree.map(lambda _: P(), x)._replace(
            momentum=jax.tree.map(lambda _: momentum_spec, x.momentum))
    return jax.tree.map(spec, opt_state, is_leaf=_is_node)


def _replica_mesh(replica_axis: str, mesh: AnyMesh | None, what: str):
    """The mesh with ``replica_axis`` (given or ambient); refuses a manual replica axis."""
    ambient = jax.sharding.get_abstract_mesh()
    if not ambient.empty and replica_axis in ambient.manual_axes:
        raise ValueError(f"{what} was called inside a shard_map over {replica_axis!r}; call it "
                         "outside (it builds its own)")
    mesh = mesh if mesh is not None else (None if ambient.empty else ambient)
    if mesh is None or replica_axis not in mesh.axis_names:
        return None
    return mesh


def stack_replica_momenta(opt_state: OptState, replica_axis: str = "dcn", *,
                          mesh: AnyMesh | None = None) -> OptState:
    """Every Dion3 momentum with one entry per replica along a new leading axis (to checkpoint).

    Under compressed sync each replica holds its own momentum in arrays declared replicated over
    ``replica_axis``: a checkpoint of them holds one replica's. This stacks them into an array
    of shape ``(R, *momentum.shape)`` sharded over ``replica_axis`` along the new axis (each
    replica's entry stays on its devices; nothing crosses the replica axis), which a checkpoint
    saves whole. :func:`unstack_replica_momenta` gives each replica its own back, and the run
    continues as if never interrupted, also under ``replica_selection="norms"`` (where
    :func:`synchronize_momentum`'s mean changes the next row selection). The other state leaves
    (count, second moments, row factors, AdamW's) are identical on every replica and stay as
    they are.

    Args:
      opt_state: an optimizer state containing :class:`dion3_jax.ScaleByDion3State` nodes.
      replica_axis: the replica mesh axis.
      mesh: the mesh; default: the ambient one (``jax.set_mesh``). Call outside the shard_map
        over ``replica_axis``.

    Returns:
      The state with every Dion3 ``momentum`` leaf stacked (``R``: the size of ``replica_axis``).

    Raises:
      ValueError: when the mesh has no ``replica_axis`` or it is already manual.

    Examples:
      >>> # saved = dion3_jax.stack_replica_momenta(opt_state, "dcn")     # then save it
      >>> # opt_state = dion3_jax.unstack_replica_momenta(restored, "dcn")  # after restoring
    """
    found = _replica_mesh(replica_axis, mesh, "stack_replica_momenta")
    if found is None:
        raise ValueError(f"replica_axis={replica_axis!r} is not an axis of the mesh; pass mesh=")
    fn = jax.shard_map(lambda s: _map_momentum(s, lambda m: m[None]), mesh=found,
                       in_specs=P(), out_specs=_specs(opt_state, P(replica_axis)),
                       axis_names={replica_axis}, check_vma=False)
    return jax.jit(fn)(opt_state)


def _replica_count(opt_state: OptState) -> int:
    """The leading size of every stacked Dion3 momentum leaf (1 without any); a ValueError
    unless each is its row factors' rank plus one and all share that size."""
    counts = set()
    for node in jax.tree.leaves(opt_state, is_leaf=_is_node):
        if not _is_node(node):
            continue
        for (path, m), d in zip(jax.tree_util.tree_flatten_with_path(node.momentum)[0],
                                jax.tree.leaves(node.momentum_scale)):
            if m.ndim != d.ndim + 1:
                raise ValueError(f"momentum{jax.tree_util.keystr(path)} has shape {m.shape} for "
                                 f"row factors of shape {d.shape}: not stacked; pass the state "
                                 "that stack_replica_momenta made (or its restored checkpoint)")
            counts.add(m.shape[0])
    if len(counts) > 1:
        raise ValueError(f"opt_state's Dion3 momenta are stacked with different replica counts "
                         f"{sorted(counts)}; pass the state that stack_replica_momenta made")
    return counts.pop() if counts else 1


def unstack_replica_momenta(opt_state: OptState, replica_axis: str = "dcn", *,
                            mesh: AnyMesh | None = None, average: bool = False) -> OptState:
    """The inverse of :func:`stack_replica_momenta`: each replica its own momentum back.

    Restore the checkpoint onto the shardings of ``stack_replica_momenta(tx.init(params))``
    (e.g. ``ocp.utils.to_shape_dtype_struct`` of it), then call this on a mesh whose
    ``replica_axis`` has as many devices as the checkpoint has replicas: the run continues
    exactly, under ``replica_selection="norms"`` as under ``"random"``.

    Args:
      opt_state: a state from :func:`stack_replica_momenta` (or restored from its checkpoint).
      replica_axis: the replica mesh axis.
      mesh: the mesh; default: the ambient one (``jax.set_mesh``).
      average: give every replica (or the one device, with no replica axis) the replicas' mean
        momentum instead, what :func:`synchronize_momentum` gives: for another mesh or one
        device. The run then continues exactly only where its updates depend on the momenta's
        mean alone (``replica_selection="random"`` with ``replica_axis`` set); under
        ``"norms"``, or without a replica axis (ℓ1 selection), the next rows selected differ.

    Returns:
      The state with every Dion3 ``momentum`` leaf shaped like its parameter again.

    Raises:
      ValueError: for a state whose momenta are not stacked, and, without ``average``, when the
        mesh has no ``replica_axis`` with as many devices as the state has replicas; the
        message says what to do.

    Examples:
      >>> # opt_state = dion3_jax.unstack_replica_momenta(restored, "dcn")
    """
    replicas = _replica_count(opt_state)
    found = _replica_mesh(replica_axis, mesh, "unstack_replica_momenta")
    if average:
        return jax.jit(lambda s: _map_momentum(
            s, lambda m: m.mean(0, dtype=jnp.float32).astype(m.dtype)))(opt_state)
    size = None if found is None else dict(zip(found.axis_names, found.axis_sizes))[replica_axis]
    if size != replicas:
        where = ("there is no mesh with it" if found is None
                 else f"the mesh's has {size} devices")
        raise ValueError(
            f"opt_state holds {replicas} replicas' momenta, and {replica_axis!r} needs "
            f"{replicas} devices to hold one each: {where}. Continue on a mesh whose "
            f"{replica_axis!r} axis has {replicas} devices (exact, also under "
            "replica_selection='norms'), or pass average=True to continue from the replicas' "
            "mean momentum (exact only for replica_selection='random' with a replica axis; "
            "under 'norms' or on one device the next rows selected differ)")
    fn = jax.shard_map(lambda s: _map_momentum(s, lambda m: m[0]), mesh=found,
                       in_specs=(_specs(opt_state, P(replica_axis)),), out_specs=P(),
                       axis_names={replica_axis}, check_vma=False)
    return jax.jit(fn)(opt_state)
