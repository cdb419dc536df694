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
"""The static plan of a Dion3 step: units, their matrix views, shape groups and k.

Everything here is plain Python data computed from the tree structure, the shapes and dtypes, the
leaves' shardings, the mesh and the static config; nothing is traced. :func:`build_plan` runs once
per such signature (the transform caches it) and resolves the options the step consults (k and
the update's shape factor per unit, the flavor, the orthogonalizer, the selection and wire
options, the passes' implementation), so the traced step (``_step``) reads the plan and never the
config; only ``mu`` and ``beta2``, which may be traced, travel beside the arrays.

A *unit* is one batch of matrices the step treats alike: a canonical block of a leaf (all of its
matrices when the leaf is not sharded along its rows), or one row segment of a row-sharded leaf
(a whole matrix, a head, or a ``split_sizes`` block, seen through each device's rows). Units
whose selected rows have the same shape, dtype and route share a *shape group*: one batched
orthogonalizer call and one collective each way. Within a group, consecutive units that the
step's small per-matrix work (row positions, NorMuon) treats alike form a *batch*: that work runs
once per batch on its members' arrays stacked along the batch axis.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from dion3_jax import _distributed, _layout, _megabatch, _rules, _selection
from dion3_jax._config import Dion3Config, PassImplementation
from dion3_jax._polar_operator import PolarOperator


class Unit(NamedTuple):
    """One batch of matrices of the step.

    Attributes:
      uid: position in :attr:`Plan.units`.
      leaf: index of the leaf (flattened tree order).
      block: index of the canonical block of the leaf.
      layout: the whole matrix: ``n`` rows, ``c`` columns; the device's batch and row axis.
      local_cols: columns of the block held by this device (``c / W`` when column-sharded).
      shard: the leaf's :data:`dion3_jax._distributed.ShardMode`.
      comm: mesh axes of the sharded matrix axis (rows/cols) or of the batch split.
      split: ``"whole"`` leaves replicated over ``comm``: the group's batch is split.
      seg: ``"rows"``: the row segment; else None.
      k: the selection rule's count, ``num_selected(f, n)``.
      pick: rows this device sends per matrix (``k`` unless the rows are sharded).
      full: every row is selected (no gather, no scatter).
      group: the unit's shape group.
      swap: the payload is transposed to the group's orientation (wide, for an orthogonalizer
        that takes only wide matrices).
      lr_scale: the update's shape factor, :func:`dion3_jax._rules.lr_scale` of the whole
        matrix under ``adjust_lr``.
      col_comm: ``"rows"`` units of a leaf sharded along its reduction axis too: the mesh axes
        of its column tiles (the row statistics are summed over them); else empty.
    """

    uid: int
    leaf: int
    block: int
    layout: _layout.BlockLayout
    local_cols: int
    shard: _distributed.ShardMode
    comm: tuple[str, ...]
    split: bool
    seg: _distributed.Segment | None
    k: int
    pick: int
    full: bool
    group: _megabatch.GroupKey
    swap: bool
    lr_scale: float
    col_comm: tuple[str, ...] = ()

    @property
    def segment(self) -> _distributed.Segment:
        """``seg`` of a ``"rows"`` unit (which always has one)."""
        if self.seg is None:
            raise ValueError(f"unit {self.uid} ({self.shard}) has no row segment")
        return self.seg

    @property
    def col_axes(self) -> tuple[str, ...]:
        """The mesh axes over which each matrix's columns are split (its row statistics are
        partial sums over them)."""
        return self.comm if self.shard == "cols" else self.col_comm

    @property
    def matrix_axes(self) -> tuple[str, ...]:
        """Every mesh axis over which each matrix is split (none for whole matrices)."""
        return () if self.shard == "whole" else self.comm + self.col_comm


class Batch(NamedTuple):
    """Consecutive units of one shape group that the step processes together.

    The members have the same orientation, whole-matrix shape, local rows, sharding, ``k`` and
    ``pick`` (so their small per-matrix arrays stack along the batch axis), and no two of them
    are the same block of a leaf (so their row updates are independent).

    Attributes:
      group: index in :attr:`Plan.groups`.
      uids: the members, in the group's order.
    """

    group: int
    uids: tuple[int, ...]


class Plan(NamedTuple):
    """The static plan of one step.

    Attributes:
      ctx: where the step runs (mesh, axes).
      leaves: per leaf, how its local shard maps to matrices.
      units: every unit, in leaf and block order.
      groups: shape groups, in first-seen order: ``(key, uids)``.
      random_selection: rows chosen from shared random scores (compressed "random" sync).
      norms_over_replicas: row scores are summed over the replica axis ("norms" sync).
      stack_on_device: on-device groups are normalized per matrix before stacking (no replica
        averaging in between).
      send_normalized: all-to-all payloads travel normalized, in the orthogonalizer's input
        dtype (the built-in orthogonalizer, no replica averaging in between); their norms are
        all-reduced first, a float per matrix.
      row_norm_uids: units whose polar norm comes from row statistics taken beside the scores.
      batches: every unit in exactly one :class:`Batch`, in group order.
      normuon: ``flavor="normuon"`` (else Muon: no second moments).
      orthogonalizer: the polar operator the groups call.
      seed: the seed of the shared random row scores (``MeshOptions.seed``).
      global_scope: row-sharded matrices select among all their rows
        (``MeshOptions.selection_scope="global"``), not per shard.
      replica_wire_dtype: the dtype of the compressed sync's replica mean
        (``MeshOptions.replica_wire_dtype``).
      pass_implementation: what runs the statistics and payload passes.
      names: the leaves' paths (for errors).
    """

    ctx: _distributed.Context
    leaves: tuple[_distributed.LeafPlan, ...]
    units: tuple[Unit, ...]
    groups: tuple[tuple[_megabatch.GroupKey, tuple[int, ...]], ...]
    random_selection: bool
    norms_over_replicas: bool
    stack_on_device: bool
    send_normalized: bool
    row_norm_uids: frozenset[int]
    batches: tuple[Batch, ...]
    normuon: bool
    orthogonalizer: PolarOperator
    seed: int
    global_scope: bool
    replica_wire_dtype: Any
    pass_implementation: PassImplementation
    names: tuple[str, ...] = ()


def _group(shard, comm, split, layout: _layout.BlockLayout, local_cols, pick, dtype, ctx,
           any_orientation: bool, kept: int | None = None, col_comm: tuple[str, ...] = ()):
    """The unit's shape group and whether its payload is transposed to the group's shape
    (``kept``: global-scope row shards, the selected rows of the assembled matrix;
    ``col_comm``: row shards that are column tiles too, the mesh axes of the columns)."""
    ra = layout.row_axis
    sent = pick * (ctx.size(comm) if shard == "rows" else 1)
    rows_assembled = sent if kept is None else kept
    # The payload keeps its layout (polar(Xᵀ) = polar(X)ᵀ, so a transpose would only move
    # memory) unless the orthogonalizer takes only wide matrices.
    keep = any_orientation or rows_assembled == layout.c
    want = ra if keep else 1 if rows_assembled < layout.c else 2
    swap = ra != want
    shape = (pick, local_cols) if (ra == 1) != swap else (local_cols, pick)
    if shard == "whole":
        route: _megabatch.Route = "split" if split else "on_device"
        return _megabatch.GroupKey(route, comm if split else (), 0, shape, dtype), swap
    concat = want if shard == "rows" else 3 - want
    return _megabatch.GroupKey("all_to_all", comm + col_comm, concat, shape, dtype,
                               0 if rows_assembled == sent else rows_assembled,
                               ctx.size(col_comm)), swap


def _whole_units(leaf: int, lp: _distributed.LeafPlan, fraction: float, dtype, ctx, start: int,
                 any_orientation: bool, adjust_lr):
    units: list[Unit] = []
    for bi, (gb, lb) in enumerate(zip(lp.layout.blocks, lp.local.blocks)):
        lay = _layout.BlockLayout(lb.batch, gb.n, gb.c, lb.row_axis)
        k = _selection.num_selected(fraction, gb.n)
        group, swap = _group(lp.shard, lp.comm, lp.split, lay, lb.c, k, dtype, ctx,
                             any_orientation)
        units.append(Unit(start + len(units), leaf, bi, lay, lb.c, lp.shard, lp.comm, lp.split,
                          None, k, k, k == gb.n, group, swap,
                          _rules.lr_scale(adjust_lr, lay.n, lay.c)))
    return units


def _row_units(leaf: int, lp: _distributed.LeafPlan, fraction: float, scope: str, dtype, ctx,
               start: int, any_orientation: bool, adjust_lr):
    lb = lp.local.blocks[0]
    units: list[Unit] = []
    for seg in lp.segments:
        lay = _layout.BlockLayout(lb.batch, seg.layout.n, seg.layout.c, lb.row_axis)
        k = _selection.num_selected(fraction, seg.layout.n)
        if scope == "local":
            pick = _selection.num_selected(fraction, seg.width)
            every = pick == seg.width
        else:
            pick, every = min(k, seg.width), k == seg.layout.n
        group, swap = _group("rows", lp.comm, False, lay, lb.c, pick, dtype, ctx,
                             any_orientation, None if scope == "local" else k, lp.col_comm)
        units.append(Unit(start + len(units), leaf, 0, lay, lb.c, "rows", lp.comm, False, seg, k,
                          pick, seg.whole and every, group, swap,
                          _rules.lr_scale(adjust_lr, lay.n, lay.c), lp.col_comm))
    return units


def _batch_key(u: Unit, leaf: _distributed.LeafPlan) -> tuple:
    """What the step's per-matrix work depends on, besides the group (local rows included)."""
    return (u.layout.row_axis, u.swap, u.layout.n, u.layout.c, leaf.local.blocks[u.block].n,
            u.shard, u.comm, u.col_comm, u.split, u.k, u.pick, u.full, u.seg and u.seg.width)


def _batches(units: list[Unit], groups, leaves) -> tuple[Batch, ...]:
    """Each group's units cut into runs of equal :func:`_batch_key` and distinct blocks."""
    out = []
    for g, (_, uids) in enumerate(groups):
        run = [uids[0]]
        for i in uids[1:]:
            u, head = units[i], units[run[0]]
            if (_batch_key(u, leaves[u.leaf]) == _batch_key(head, leaves[head.leaf])
                    and all((units[j].leaf, units[j].block) != (u.leaf, u.block) for j in run)):
                run.append(i)
                continue
            out.append(Batch(g, tuple(run)))
            run = [i]
        out.append(Batch(g, tuple(run)))
    return tuple(out)


def _leaf_plans(cfg: Dion3Config, tree, leaves, ctx) -> list[_distributed.LeafPlan]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    dn = _layout.per_leaf(cfg.dimension_numbers, tree)
    nh = _layout.per_leaf(cfg.num_heads, tree)
    ss = _layout.per_leaf(cfg.split_sizes, tree)
    if ctx.distributed:
        specs = _distributed.leaf_specs(ctx, leaves, cfg.mesh_options.param_specs, tree)
    else:
        specs = [((),) * len(leaf.shape) for leaf in leaves]
    plans, errors = [], []
    for (path, leaf), spec in zip(flat, specs):
        try:
            plans.append(_distributed.make_plan(ctx, spec, tuple(leaf.shape), dn(path), nh(path),
                                                ss(path), _layout.path_str(path)))
        except ValueError as e:
            errors.append(str(e))
    if len(errors) == 1:
        raise ValueError(errors[0])
    if errors:
        raise ValueError(f"{len(errors)} leaves cannot be orthogonalized as given:\n  - "
                         + "\n  - ".join(errors))
    return plans


def leaf_plans(cfg: Dion3Config, tree) -> tuple[_distributed.Context, list]:
    """The context and per-leaf plans of a params-like tree (what ``init`` needs)."""
    leaves = jax.tree.leaves(tree)
    opts = cfg.mesh_options
    ctx = _distributed.resolve_context(opts.mesh, opts.shard_axis, opts.replica_axis, leaves)
    return ctx, _leaf_plans(cfg, tree, leaves, ctx)


def build_plan(cfg: Dion3Config, grads, momentum_dtypes) -> Plan:
    """The plan of a step on ``grads`` (a tree) with momenta of ``momentum_dtypes`` (a list)."""
    ctx, leaves = leaf_plans(cfg, grads)
    scope = cfg.mesh_options.selection_scope
    anyo = cfg.orthogonalizer.any_orientation
    units: list[Unit] = []
    for li, (lp, dtype) in enumerate(zip(leaves, momentum_dtypes)):
        dtype = jnp.dtype(dtype)
        if lp.shard == "rows":
            units += _row_units(li, lp, cfg.fraction, scope, dtype, ctx, len(units), anyo,
                                cfg.adjust_lr)
        else:
            units += _whole_units(li, lp, cfg.fraction, dtype, ctx, len(units), anyo,
                                  cfg.adjust_lr)
    groups: dict[_megabatch.GroupKey, dict[tuple, list[int]]] = {}
    for u in units:   # a group's members ordered by batch key: fewer, larger batches
        groups.setdefault(u.group, {}).setdefault(_batch_key(u, leaves[u.leaf]), []).append(u.uid)
    replica = ctx.replica_axis is not None
    stack = not ctx.compressed
    norms = stack and cfg.orthogonalizer.takes_norms
    row_norms = frozenset(
        u.uid for u in units if norms and not u.full and (
            u.group.route == "all_to_all" or (u.shard == "whole" and not u.split)))
    group_list = tuple((k, tuple(i for run in v.values() for i in run))
                       for k, v in groups.items())
    opts = cfg.mesh_options
    names = tuple(_layout.path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(grads)[0])
    return Plan(ctx, tuple(leaves), tuple(units), group_list,
                replica and opts.replica_selection == "random",
                ctx.compressed and opts.replica_selection == "norms",
                stack, norms, row_norms, _batches(units, group_list, leaves),
                cfg.flavor == "normuon", cfg.orthogonalizer, opts.seed, scope == "global",
                opts.replica_wire_dtype, cfg.pass_implementation, names)
