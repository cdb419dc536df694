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
"""Mesh context and per-leaf sharding plans for the distributed Dion3 step.

Everything here is static (computed at trace time from shapes, the mesh and the leaves'
shardings). The step itself (``_transform``) runs inside one ``jax.shard_map`` over the mesh axes
that are not already manual; this module decides, per leaf, how its local shard maps onto whole
matrices:

``"whole"``
  every device holds whole matrices: the leaf is replicated over the shard axes (then the group's
  batch of matrices is split across the shard axes and all-gathered: ``split=True``), or it is
  sharded along a batch axis (stacked layers, experts, whole heads: ``split=False``, no
  communication), or there is no mesh at all (one device).
``"rows"``
  sharded along its output axis: each device holds a contiguous range of rows; the selected rows
  travel (one all-to-all per shape group) and are assembled into whole (k × C) matrices.
``"cols"``
  sharded along its reduction axis: each device holds every row and a range of columns; row norms
  are all-reduced (n floats per matrix), so the selection is exact, and the selected rows' column
  shards travel.

The modes combine: a leaf may be sharded along any of its batch axes as well (they only shrink
each device's batch), and a ``"rows"`` leaf may be sharded along its reduction axis too, so that
each device holds a tile (``col_comm``: FSDP × TP layouts). A tile's row norms are all-reduced
over its column axes, every column tile of a row range then selects the same rows, and one
all-to-all over the row and column axes together assembles whole ``k × C`` matrices.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
import math
from typing import Any, Literal, NamedTuple

import jax
from jax.sharding import AxisType, PartitionSpec as P
import numpy as np

from dion3_jax import _layout, _numbers
from dion3_jax._types import PerLeaf

SELECTION_SCOPES = ("local", "global")
REPLICA_SELECTIONS = ("random", "norms")
ShardMode = Literal["whole", "rows", "cols"]


def _as_axes(axis, what: str) -> tuple[str, ...] | None:
    if axis is None:
        return None
    axes: tuple[str, ...]
    if isinstance(axis, str):
        axes = (axis,)
    elif isinstance(axis, (tuple, list)):
        axes = tuple(axis)
    else:
        axes = ()
    if not axes or not all(isinstance(a, str) for a in axes):
        raise ValueError(f"{what} must be a mesh axis name or a tuple of names, got "
                         f"{what}={axis!r}")
    if len(set(axes)) != len(axes):
        raise ValueError(f"{what} repeats an axis: {what}={axis!r}")
    return axes


class MeshOptions(NamedTuple):
    """How :func:`dion3_jax.scale_by_dion3` runs on a device mesh (all optional).

    Attributes:
      mesh: the device mesh. Default: the ambient one (``jax.set_mesh``), else the mesh of the
        leaves' shardings; none → the single-device path.
      shard_axis: the FSDP mesh axis or axes (a name or a tuple); replicated matrices are split
        across them. Default: every mesh axis except ``replica_axis`` and manual axes.
      replica_axis: the slow data-parallel axis (e.g. ``"dcn"``), or None. Parameters must be
        replicated over it. When ``update`` is called inside a ``jax.shard_map`` that makes it
        manual, gradients are per replica and only the selected rows are averaged over it
        (compressed sync; see :func:`dion3_jax.synchronize_momentum`).
      selection_scope: on row-sharded matrices, ``"local"`` (each shard selects its own
        ``ceil(f·ceil(n/W))`` rows; only those travel) or ``"global"`` (exact top-k of the whole
        matrix; the result does not depend on the mesh). Elsewhere both are exact.
      replica_selection: with ``replica_axis``: ``"random"`` (row set from a PRNG key shared by
        the replicas; the update equals the fully synchronized one exactly) or ``"norms"``
        (top-k of the row ℓ1 norms summed over replicas; only the norms are all-reduced).
      seed: int seed of the ``"random"`` replica selection.
      param_specs: the leaves' ``PartitionSpec`` s (one spec, a tree or a callable; under Auto
        axes a leaf it does not cover is replicated), required when mesh axes are Auto (traced
        values carry no sharding there; without it ``init`` and ``update`` raise rather than
        guess a layout).
        Under Explicit axes the shardings are read from the leaves.
      replica_wire_dtype: under compressed sync, the dtype the selected rows' average crosses
        ``replica_axis`` in: None (the default: the momentum's dtype, float32 unless
        ``mu_dtype`` says otherwise; "random" selection then equals the fully synchronized
        update to rounding) or float16 (half of float32's bytes; each matrix is scaled by the
        replicas' largest entry first; the update's error stays at the float16 polar's own and
        the momentum moves by about 5e-4 relative, measured by
        ``benchmarks/replica_sync_dtype.py``). bfloat16 is refused: it adds 40–100% to the
        update's error.
    """

    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None
    shard_axis: str | Sequence[str] | None = None
    replica_axis: str | None = None
    selection_scope: Literal["local", "global"] = "local"
    replica_selection: Literal["random", "norms"] = "random"
    seed: int = 0
    param_specs: PerLeaf[P] | None = None
    replica_wire_dtype: jax.typing.DTypeLike | None = None


def check_mesh_options(options: MeshOptions) -> None:
    """Validates :class:`MeshOptions` (at construction of the transform)."""
    if not isinstance(options, MeshOptions):
        raise TypeError(f"mesh_options must be a dion3_jax.MeshOptions, got {options!r}")
    mesh, replica_axis = options.mesh, options.replica_axis
    if mesh is not None and not isinstance(mesh, (jax.sharding.Mesh,
                                                  jax.sharding.AbstractMesh)):
        raise ValueError(f"mesh must be a jax.sharding.Mesh or AbstractMesh, got {mesh=!r}")
    shard = _as_axes(options.shard_axis, "shard_axis")
    if replica_axis is not None and not isinstance(replica_axis, str):
        raise ValueError(f"replica_axis must be one mesh axis name or None, got {replica_axis=!r}")
    if shard and replica_axis in shard:
        raise ValueError(f"replica_axis={replica_axis!r} cannot also be a shard axis "
                         f"(shard_axis={options.shard_axis!r})")
    for name, value, allowed in (("selection_scope", options.selection_scope, SELECTION_SCOPES),
                                 ("replica_selection", options.replica_selection,
                                  REPLICA_SELECTIONS)):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {name}={value!r}")
    if mesh is not None:
        for a in (shard or ()) + ((replica_axis,) if replica_axis else ()):
            if a not in tuple(mesh.axis_names):
                raise ValueError(f"mesh axis {a!r} (from shard_axis / replica_axis) is not an axis "
                                 f"of the mesh {tuple(mesh.axis_names)}")
    _check_seed_and_specs(options.seed, options.param_specs)
    _check_wire_dtype(options.replica_wire_dtype)


def _check_wire_dtype(dtype) -> None:
    try:
        ok = dtype is None or np.dtype(dtype) == np.dtype(np.float16)
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"replica_wire_dtype must be None (the momentum's dtype) or float16, "
                         f"got {dtype!r}; bfloat16 is refused: it adds 40-100% to the update's "
                         "error (benchmarks/replica_sync_dtype.py)")


def _check_seed_and_specs(seed, param_specs) -> None:
    if isinstance(seed, jax.core.Tracer):
        raise ValueError("seed must be a static int")
    if not _numbers.is_int(seed):
        raise TypeError(f"seed must be an int, got {seed=!r}")
    if param_specs is not None and not (callable(param_specs) or isinstance(param_specs, P)
                                        or not _layout.is_single_value(param_specs)):
        raise ValueError(f"param_specs must be a PartitionSpec, a tree of them or a callable, got "
                         f"{param_specs=!r}")


@dataclasses.dataclass(frozen=True)
class Context:
    """Where the step runs.

    Attributes:
      mesh: the (abstract) mesh, or None on one device.
      axis_names: the mesh axes the step's shard_map makes manual (all that are not manual yet).
      shard_axes: FSDP axes (non-manual): replicated matrices are split across them.
      replica_axis: the slow data-parallel axis, or None.
      compressed: True when the replica axis is already manual (``update`` is called inside a
        shard_map over it, with per-replica gradients): only the selected rows are averaged.
      sizes: mesh axis sizes.
    """

    mesh: Any
    axis_names: tuple[str, ...]
    shard_axes: tuple[str, ...]
    replica_axis: str | None
    compressed: bool
    sizes: dict
    concrete_mesh: Any = None

    @property
    def distributed(self) -> bool:
        return self.mesh is not None and bool(self.axis_names)

    def size(self, axes: Sequence[str]) -> int:
        return math.prod(self.sizes[a] for a in axes)

    def auto(self) -> bool:
        """True when some step axis has Auto type (leaf shardings are not in the types)."""
        if self.mesh is None:
            return False
        types = dict(zip(self.mesh.axis_names, self.mesh.axis_types))
        return any(types[a] == AxisType.Auto for a in self.axis_names)


def _mesh_of_leaves(leaves) -> Any:
    for x in leaves:
        try:
            sh = jax.typeof(x).sharding
        except Exception:  # noqa: BLE001 - plain numpy inputs
            continue
        mesh = getattr(sh, "mesh", None)
        if mesh is not None and not mesh.empty:
            return mesh
    for x in leaves:
        sh = getattr(x, "sharding", None)
        if isinstance(sh, jax.sharding.NamedSharding):
            return sh.mesh.abstract_mesh
    return None


def resolve_context(mesh, shard_axis, replica_axis, leaves) -> Context:
    """The mesh (argument, ambient ``jax.set_mesh`` or the leaves' own) and the axis roles."""
    ambient = jax.sharding.get_abstract_mesh()
    concrete = mesh if isinstance(mesh, jax.sharding.Mesh) else None
    if mesh is not None:
        given = mesh.abstract_mesh if isinstance(mesh, jax.sharding.Mesh) else mesh
        # The ambient mesh knows which axes are manual (inside a shard_map); prefer it.
        mesh = ambient if (not ambient.empty
                           and tuple(ambient.axis_names) == tuple(given.axis_names)) else given
    else:
        mesh = ambient if not ambient.empty else _mesh_of_leaves(leaves)
        if mesh is not None and mesh.empty:
            mesh = None
    if mesh is None:
        if replica_axis is not None or shard_axis is not None:
            names = (_as_axes(shard_axis, "shard_axis") or ()) + (
                (replica_axis,) if replica_axis else ())
            raise ValueError(f"mesh axes {names} were given but there is no mesh: pass mesh= or "
                             "call update under jax.set_mesh(mesh)")
        return Context(None, (), (), None, False, {})
    names = tuple(mesh.axis_names)
    sizes = dict(zip(names, mesh.axis_sizes))
    types = dict(zip(names, mesh.axis_types))
    manual = tuple(a for a in names if types[a] == AxisType.Manual)
    shard = _as_axes(shard_axis, "shard_axis")
    for a in (shard or ()) + ((replica_axis,) if replica_axis else ()):
        if a not in names:
            raise ValueError(f"mesh axis {a!r} (from shard_axis / replica_axis) is not an axis of "
                             f"the mesh {names}")
    if shard is None:
        shard = tuple(a for a in names if a != replica_axis and a not in manual)
    elif any(a in manual for a in shard):
        raise ValueError(f"shard_axis={shard_axis!r} names an axis that is already manual "
                         f"({manual}); call update outside the shard_map over it")
    # A manual axis other than the replica axis: the step would see each device's shard of a
    # leaf sharded over it as a whole matrix (a per-shard update, no error). An axis of size 1
    # has no shards.
    other = tuple(a for a in manual if a != replica_axis and sizes[a] > 1)
    if other:
        raise ValueError(
            f"update was called inside a jax.shard_map that makes the mesh axes {other} manual: "
            "the step would take each device's shard of a parameter for a whole matrix and "
            "orthogonalize it on its own. Call update outside that shard_map (under jax.jit "
            "with the mesh; each leaf keeps its sharding), or, if the parameters are replicated "
            f"over {other[0]!r} (data parallel, per-replica gradients), pass "
            f"MeshOptions(replica_axis={other[0]!r}) for compressed sync over it")
    axis_names = tuple(a for a in names if a not in manual)
    compressed = replica_axis is not None and replica_axis in manual
    return Context(mesh, axis_names, shard, replica_axis, compressed, sizes, concrete)


# ---------------------------------------------------------------------------------------------
# Leaf specs


def spec_entries(spec, ndim: int) -> tuple[tuple[str, ...], ...]:
    """A ``PartitionSpec``'s mesh axes for each of ``ndim`` leaf axes (empty: unsharded)."""
    spec = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
    out: list[tuple[str, ...]] = []
    for e in spec[:ndim]:
        if e is None or e is P.UNCONSTRAINED:
            out.append(())
        elif isinstance(e, str):
            out.append((e,))
        else:
            out.append(tuple(e))
    return tuple(out)


def _spec_of(entries, auto: bool = False) -> P:
    """The spec of per-dimension mesh axes, in the form jit gives its outputs: one entry per
    dimension under Explicit axes, without trailing Nones under Auto axes (``auto``), so that a
    state placed by ``init`` and one returned by ``update`` key the same compiled program."""
    spec = [None if not e else (e[0] if len(e) == 1 else e) for e in entries]
    while auto and spec and spec[-1] is None:
        spec.pop()
    return P(*spec)


def leaf_specs(ctx: Context, leaves, param_specs, tree) -> list[tuple[tuple[str, ...], ...]]:
    """Per leaf, the mesh axes of each of its dimensions (restricted to the step's axes).

    Raises:
      ValueError: under Auto axes of more than one device without ``param_specs``: traced
        values carry no sharding there, and a guessed layout would move the user's.
    """
    lookup = None
    if param_specs is not None:
        if isinstance(param_specs, P):
            lookup = lambda path: param_specs  # noqa: E731
        else:
            lookup = _layout.per_leaf(param_specs, tree)
    elif ctx.auto() and ctx.size(ctx.axis_names) > 1:
        raise ValueError(
            f"the mesh axes {ctx.axis_names} are Auto: traced values carry no sharding, so Dion3 "
            "cannot see how each leaf is laid out (and will not guess: that would move the "
            "layout). Pass the specs the params are placed with, e.g. dion3_jax.MeshOptions("
            "param_specs=jax.tree.map(lambda p: p.sharding.spec, params)), or make the mesh "
            "axes Explicit (jax.make_mesh(..., axis_types=(AxisType.Explicit, ...)))")
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    out = []
    for (path, _), x in zip(flat, leaves):
        ndim = len(x.shape)
        spec = None if lookup is None else lookup(path)
        if spec is None and not ctx.auto():
            sh = getattr(jax.typeof(x), "sharding", None)
            spec = getattr(sh, "spec", None)
            if spec is None and isinstance(getattr(x, "sharding", None),
                                           jax.sharding.NamedSharding):
                spec = x.sharding.spec
        ent = spec_entries(spec if spec is not None else P(), ndim)
        ent = tuple(tuple(a for a in e if a in ctx.axis_names) for e in ent)
        out.append(ent)
    return out


# ---------------------------------------------------------------------------------------------
# Leaf plans


@dataclasses.dataclass(frozen=True)
class Segment:
    """A matrix (block of rows) of a row-sharded leaf, as seen by every device.

    Attributes:
      layout: the global block (n rows, c columns, batch).
      start: per device, first local row of the segment (static table).
      count: per device, number of the segment's rows held locally (0: an empty shard).
      width: max of ``count`` (every device works on ``width`` padded rows).
    """

    layout: _layout.BlockLayout
    start: tuple[int, ...]
    count: tuple[int, ...]
    width: int

    @property
    def whole(self) -> bool:
        """True when the segment is the device's whole local block on every device."""
        return all(s == 0 for s in self.start) and all(c == self.width for c in self.count)


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """How one leaf's local shard is processed.

    Attributes:
      spec: the leaf's PartitionSpec (in/out spec of the shard_map).
      var_spec: the spec of its per-row second moments (reduction axes unsharded).
      shard: how the leaf's matrices are split across devices: ``"whole"`` (each device holds
        whole matrices), ``"rows"`` or ``"cols"`` (see the module docstring).
      comm: mesh axes of the sharded matrix axis (rows/cols) or of the batch split (local).
      split: ``"whole"``: the leaf is replicated over ``comm`` and the group's batch is split.
      layout: the global leaf layout (numbers of rows/columns for k, lr scale).
      local: the layout of the local shard (its blocks are what the device sees).
      segments: rows mode: the matrices of the local block (whole leaf, heads or split sizes).
      col_comm: rows mode: mesh axes of the reduction axis as well (each device holds a tile:
        a row range of a column range); else empty.
    """

    spec: P
    var_spec: P
    shard: ShardMode
    comm: tuple[str, ...]
    split: bool
    layout: _layout.LeafLayout
    local: _layout.LeafLayout
    segments: tuple[Segment, ...] = ()
    col_comm: tuple[str, ...] = ()


def _sharded_axes(ctx: Context, entries, glob: _layout.LeafLayout, shape, name: str):
    """The leaf's sharded batch axes, its one sharded reduction axis and its one sharded output
    axis (None where unsharded), checked: no replica axis, even divisions."""
    spec = _spec_of(entries)
    if ctx.replica_axis is not None and any(ctx.replica_axis in e for e in entries):
        raise ValueError(f"{name} ({shape=}, {spec}) is sharded over the replica axis "
                         f"{ctx.replica_axis!r}; parameters must be replicated across replicas")
    for i, e in enumerate(entries):
        if e and shape[i] % ctx.size(e):
            raise ValueError(f"{name} ({shape=}, {spec}): axis {i} of size {shape[i]} does not "
                             f"divide evenly over mesh axes {e} ({ctx.size(e)} devices)")
    sharded = [i for i, e in enumerate(entries) if e]
    red = [i for i in sharded if i in glob.reduction_axes]
    out = [i for i in sharded if i in glob.output_axes]
    for what, axes in (("reduction", red), ("output", out)):
        if len(axes) > 1:
            raise ValueError(f"{name} ({shape=}, {spec}) is sharded along {len(axes)} of its "
                             f"{what} axes {tuple(axes)}; Dion3 takes at most one sharded "
                             f"{what} axis (shard one of them over a tuple of mesh axes, e.g. "
                             "P(('a', 'b'), None))")
    batch = [i for i in sharded if i not in red and i not in out]
    return batch, red[0] if red else None, out[0] if out else None


def make_plan(ctx: Context, entries, shape, dn, num_heads, split_sizes, name: str) -> LeafPlan:
    """Builds the plan of one leaf from its dimension specs.

    A leaf may be sharded along any of its batch axes, along one reduction axis and along one
    output axis, each over one mesh axis or a tuple of them. Batch shards only divide the batch
    (no communication); the output axis makes it ``"rows"``, the reduction axis ``"cols"``, and
    both a ``"rows"`` leaf of column tiles (``col_comm``).
    """
    glob = _layout.make_layout(shape, dn, num_heads, split_sizes, name=name)
    spec = _spec_of(entries, ctx.auto())
    var_spec = _spec_of(tuple(() if i in glob.reduction_axes else e
                              for i, e in enumerate(entries)), ctx.auto())
    batch, red, out = _sharded_axes(ctx, entries, glob, shape, name)
    if red is None and out is None and not batch:
        comm = tuple(a for a in ctx.shard_axes if ctx.sizes.get(a, 1) > 1)
        return LeafPlan(spec, var_spec, "whole", comm, bool(comm), glob, glob)
    local_shape = tuple(s // ctx.size(e) if e else s for s, e in zip(shape, entries))
    cols = entries[red] if red is not None else ()
    heads = glob.num_heads
    if out is not None and (heads > 1 or len(glob.split_sizes) > 1):
        if out != glob.output_axes[0]:
            raise ValueError(f"{name} ({shape=}, {spec}): with num_heads / split_sizes only the "
                             "leading output axis may be sharded")
        w = ctx.size(entries[out])
        n_loc = math.prod(shape[i] for i in glob.output_axes) // w
        if heads > 1 and n_loc % glob.blocks[0].n == 0:  # whole heads on each device: batch-like
            batch, out, heads = batch + [out], None, heads // w
    if out is None:
        local = _layout.make_layout(local_shape, dn, heads, split_sizes, name=name)
        if red is not None:
            return LeafPlan(spec, var_spec, "cols", cols, False, glob, local)
        comm = tuple(a for i in batch for a in entries[i])
        return LeafPlan(spec, var_spec, "whole", comm, False, glob, local)
    local = _layout.make_layout(local_shape, dn, None, None, name=name)
    segments = _segments(glob, local, shape, ctx.size(entries[out]))
    return LeafPlan(spec, var_spec, "rows", entries[out], False, glob, local, segments, cols)


def _segments(glob: _layout.LeafLayout, local: _layout.LeafLayout, shape, w: int
              ) -> tuple[Segment, ...]:
    """The row segments (whole leaf, heads or split blocks) of a leaf whose output axis is
    split into ``w`` contiguous ranges, as each device sees them."""
    n_loc = math.prod(shape[i] for i in glob.output_axes) // w
    blocks = glob.blocks
    if glob.num_heads > 1:
        ranges = [(h * blocks[0].n, blocks[0].n) for h in range(glob.num_heads)]
        per_block = [dataclasses.replace(blocks[0], batch=local.blocks[0].batch)] * len(ranges)
    else:
        offs = np.cumsum((0,) + glob.split_sizes[:-1])
        ranges = [(int(o), s) for o, s in zip(offs, glob.split_sizes)]
        per_block = [dataclasses.replace(b, batch=local.blocks[0].batch) for b in blocks]
    segments = []
    for (off, size), bl in zip(ranges, per_block):
        starts, counts = [], []
        for d in range(w):
            lo, hi = max(off, d * n_loc), min(off + size, (d + 1) * n_loc)
            c = max(0, hi - lo)
            counts.append(c)
            starts.append(lo - d * n_loc if c else 0)
        segments.append(Segment(bl, tuple(starts), tuple(counts), max(counts)))
    return tuple(segments)


def shard_map(ctx: Context, fn: Callable, in_specs, out_specs) -> Callable:
    """``jax.shard_map`` over the context's (non-manual) axes."""
    return jax.shard_map(fn, mesh=ctx.mesh, in_specs=in_specs, out_specs=out_specs,
                         axis_names=set(ctx.axis_names), check_vma=False)
