"""``scale_by_dion3``: momentum accumulation, top-ℓ1 row selection, error feedback, polar, NorMuon.

Per matrix (canonical block, rows = outputs), per step, with gradient G, momentum M and per-row
second moment v::

    M ← M + G
    I = the k = max(1, ceil(f·n)) rows of M with the largest ℓ1 norm
    S = M[I]; M[I] ← μ·S                       (error feedback: only selected rows decay)
    O = polar(S)
    NorMuon: ν = mean_j O², v[I] ← β₂·v[I] + (1−β₂)·ν, D = O / (√v[I] + 1e-8), rescaled to ‖O‖_F
    Muon:    D = O
    update[I] = scale(n, C) · D, zero elsewhere

The learning rate and decoupled weight decay are applied by the alias (``dion3_jax.dion3``):
``W ← W − lr·(wd·W + update)``.

References:
  Amsel, Zhang, Ahn, Naeimi, Feng, Chen, Dao, Langford, `Dion3: Full-Stack Orthogonal Updates
  <https://arxiv.org/abs/2608.11612>`_, 2026.
  Ahn et al., `Dion: Distributed Orthonormalized Updates <https://arxiv.org/abs/2504.05295>`_,
  2025.
  Li et al., `NorMuon: Making Muon more efficient and scalable
  <https://arxiv.org/abs/2510.05491>`_, 2025.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import math
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dion3_jax import _distributed, _layout, _megabatch, _replica_sync, _selection
from dion3_jax._polar import Orthogonalizer, make_orthogonalizer, resolved_compute_dtype

Flavour = Literal["normuon", "muon"]
AdjustLR = Literal["spectral_norm", "rms_norm"] | None
_FLAVOURS = ("normuon", "muon")
_ADJUST = ("spectral_norm", "rms_norm", None)
NORMUON_EPS = 1e-8


class ScaleByDion3State(NamedTuple):
    """State of :func:`scale_by_dion3`."""

    count: jax.Array  # shape=(), dtype=int32: number of updates applied.
    momentum: optax.Updates  # like params; dtype mu_dtype (default: each param's dtype).
    # Per-row second moments: each param's shape with its reduction axes of size 1, float32.
    # None for flavour="muon".
    variance: optax.Updates | None


def lr_scale(adjust_lr: AdjustLR, fan_out: int, fan_in: int) -> float:
    """Shape factor η'/lr of one (fan_out × fan_in) matrix.

    ``"spectral_norm"``: √(fan_out/fan_in); ``"rms_norm"``: 0.2·√max(fan_out, fan_in) (Moonshot's
    AdamW-compatible scale); ``None``: 1.
    """
    if adjust_lr == "spectral_norm":
        return math.sqrt(fan_out / fan_in)
    if adjust_lr == "rms_norm":
        return 0.2 * math.sqrt(max(fan_out, fan_in))
    return 1.0


def _is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def check_fraction(fraction) -> float:
    """Validates the static selected fraction and returns it as a Python float."""
    if _is_tracer(fraction):
        raise ValueError(
            "fraction must be a static Python number (it fixes array shapes); with "
            "optax.inject_hyperparams pass static_args=('fraction',)")
    try:
        f = float(fraction)
    except (TypeError, ValueError) as e:
        raise ValueError(f"fraction must be a number in (0, 1], got {fraction=!r}") from e
    if not 0.0 < f <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction=!r}")
    return f


def check_range(name: str, value, lo: float, hi: float, hi_open: bool = False) -> None:
    """Raises ValueError when a concrete ``value`` is outside ``[lo, hi]`` (or ``[lo, hi)``)."""
    if value is None or callable(value) or _is_tracer(value):
        return
    try:
        v = float(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be a number, got {name}={value!r}") from e
    ok = lo <= v < hi if hi_open else lo <= v <= hi
    if not ok or math.isnan(v):
        bracket = ")" if hi_open else "]"
        raise ValueError(f"{name} must be in [{lo}, {hi}{bracket}, got {name}={value!r}")


class _Unit(NamedTuple):
    """One matrix batch of the step (static): a local block, or a row segment of a local block.

    ``layout`` has the global matrix numbers (n rows, c columns) and the local batch and row
    axis; ``pick`` rows per matrix are sent by this device (``k`` is the selection rule's count).
    """

    leaf: int
    block: int
    layout: _layout.BlockLayout
    mode: str                      # "local" | "rows" | "cols"
    comm: tuple[str, ...]
    split: bool
    seg: _distributed.Segment | None
    k: int
    pick: int
    full: bool
    uid: int


def _make_units(plans, fraction: float, scope: str, ctx: _distributed.Context) -> list[_Unit]:
    units = []
    for li, plan in enumerate(plans):
        if plan.mode != "rows":
            for bi, (gb, lb) in enumerate(zip(plan.layout.blocks, plan.local.blocks)):
                lay = _layout.BlockLayout(lb.batch, gb.n, gb.c, lb.row_axis)
                k = _selection.num_selected(fraction, gb.n)
                units.append(_Unit(li, bi, lay, plan.mode, plan.comm, plan.split, None, k, k,
                                   k == gb.n, len(units)))
            continue
        lb = plan.local.blocks[0]
        for seg in plan.segments:
            lay = _layout.BlockLayout(lb.batch, seg.layout.n, seg.layout.c, lb.row_axis)
            k = _selection.num_selected(fraction, seg.layout.n)
            if scope == "local":
                pick = min(seg.width, max(1, math.ceil(fraction * seg.width)))
            else:
                pick = min(k, seg.width)
            every = pick == seg.width if scope == "local" else k == seg.layout.n
            units.append(_Unit(li, 0, lay, "rows", plan.comm, False, seg, k, pick,
                               seg.whole and every, len(units)))
    return units


def _batched_psum(items: list[tuple[jax.Array, tuple[str, ...]]]) -> list[jax.Array]:
    """psum of each array over its axes, with ONE collective per distinct axes tuple."""
    out: list[jax.Array | None] = [None] * len(items)
    by_axes: dict[tuple, list[int]] = {}
    for i, (x, axes) in enumerate(items):
        if not axes:
            out[i] = x
        else:
            by_axes.setdefault(axes, []).append(i)
    for axes, idx in by_axes.items():
        flat = jnp.concatenate([items[i][0].reshape(-1) for i in idx])
        flat = jax.lax.psum(flat, axes)
        off = 0
        for i in idx:
            x = items[i][0]
            out[i] = flat[off:off + x.size].reshape(x.shape)
            off += x.size
    return out  # type: ignore[return-value]


def _batched_all_gather(items: list[tuple[jax.Array, tuple[str, ...]]]) -> list[jax.Array]:
    """all_gather (new leading device axis) of each array, ONE collective per axes tuple."""
    out: list[jax.Array | None] = [None] * len(items)
    by_axes: dict[tuple, list[int]] = {}
    for i, (_, axes) in enumerate(items):
        by_axes.setdefault(axes, []).append(i)
    for axes, idx in by_axes.items():
        flat = jnp.concatenate([items[i][0].reshape(-1) for i in idx])
        g = jax.lax.all_gather(flat, axes, axis=0)            # (W, total)
        off = 0
        for i in idx:
            x = items[i][0]
            out[i] = g[:, off:off + x.size].reshape((g.shape[0], *x.shape))
            off += x.size
    return out  # type: ignore[return-value]


def _orient(x: jax.Array, swap: bool) -> jax.Array:
    return jnp.swapaxes(x, 1, 2) if swap else x


class _StepConfig(NamedTuple):
    fraction: float
    mu: Any
    beta2: Any
    flavour: str
    adjust_lr: Any
    scope: str
    replica_selection: str
    seed: int
    orthogonalizer: Callable


def _step(cfg: _StepConfig, ctx: _distributed.Context, plans, units, grads, moms, vars_,
          count):
    """The per-device Dion3 step (inside shard_map, or directly on one device)."""
    normuon = cfg.flavour == "normuon"
    mu = jnp.asarray(cfg.mu, jnp.float32)
    replica = ctx.replica_axis
    random_sel = replica is not None and cfg.replica_selection == "random"
    norms_sync = ctx.compressed and cfg.replica_selection == "norms"

    mblk = [p.local.to_blocks(m + g.astype(m.dtype)) for p, g, m in zip(plans, grads, moms)]
    vblk = [p.local.to_blocks(v) if normuon else None for p, v in zip(plans, vars_)]

    def shard_index(u):
        return jax.lax.axis_index(u.comm) if u.comm else 0

    # A one-device group of whole matrices is normalised per matrix before it is stacked
    # (Orthogonalizer.stacked); a selected payload's norm then comes from row statistics taken
    # beside the scores (‖M[I]‖_F² = Σ_{i∈I} ‖M_i‖²), so the gathered rows are read once.
    stack_local = not ctx.compressed and isinstance(cfg.orthogonalizer, Orthogonalizer)
    rows_sq: dict[tuple[int, int], jax.Array] = {}
    if stack_local and _selection.norms_from_rows():
        for u in units:
            key = (u.leaf, u.block)
            if u.mode == "local" and not u.split and not u.full and key not in rows_sq:
                rows_sq[key] = _selection.row_sq_norms(mblk[u.leaf][u.block],
                                                       u.layout.row_axis)

    # 1. Scores (row ℓ1 norms, summed over column shards / replicas; or shared random numbers).
    raw: dict[tuple[int, int], jax.Array] = {}
    if not random_sel:
        items, keys = [], []
        for u in units:
            key = (u.leaf, u.block)
            if u.full or key in keys:
                continue
            s = _selection.row_l1_norms(mblk[u.leaf][u.block], u.layout.row_axis)
            axes = (u.comm if u.mode == "cols" else ()) + ((replica,) if norms_sync else ())
            items.append((s, axes))
            keys.append(key)
        raw = dict(zip(keys, _batched_psum(items)))

    scores: dict[int, jax.Array] = {}
    pos: dict[int, tuple] = {}
    for u in units:
        if u.full:
            continue
        if u.mode != "rows":
            if random_sel:
                fold = shard_index(u) if (u.mode == "local" and not u.split and u.comm) else None
                scores[u.uid] = _replica_sync.random_scores(
                    cfg.seed, count, u.uid, (u.layout.batch, u.layout.n), fold)
            else:
                scores[u.uid] = raw[(u.leaf, u.block)]
            continue
        seg = u.seg
        d = shard_index(u)
        start, cnt = _selection.local_positions(seg.start, seg.count, seg.width, d)
        pos[u.uid] = (start, cnt)
        shifted = any(s != 0 for s in seg.start)
        if random_sel:
            w = ctx.size(u.comm)
            if cfg.scope == "local":
                r = _replica_sync.random_scores(cfg.seed, count, u.uid,
                                                (u.layout.batch, seg.width), d)
            else:
                r = _replica_sync.random_scores(cfg.seed, count, u.uid,
                                                (u.layout.batch, w * seg.width))
                r = jax.lax.dynamic_slice_in_dim(r, d * seg.width, seg.width, axis=1)
            valid = jnp.arange(seg.width) < cnt
            scores[u.uid] = jnp.where(valid[None], r, -jnp.inf)
        else:
            scores[u.uid] = _selection.segment_scores(raw[(u.leaf, u.block)], start, cnt,
                                                      seg.width, shifted)

    # Global scope on row shards: every device sees every row's score (n floats per matrix).
    gathered: dict[int, jax.Array] = {}
    if cfg.scope == "global":
        items = [(scores[u.uid], u.comm) for u in units
                 if u.mode == "rows" and not u.full]
        uids = [u.uid for u in units if u.mode == "rows" and not u.full]
        for uid, g in zip(uids, _batched_all_gather(items)):
            gathered[uid] = g                                 # (W, batch, width)

    # 2. Picks: local row indices (out-of-range = padding) and the payload S = M[I]. The first
    #    top-k of every unit runs batched: one per (rows, k) shape.
    requests: dict[int, tuple[jax.Array, int]] = {}
    for u in units:
        if u.full:
            continue
        if u.mode != "rows":
            requests[u.uid] = (scores[u.uid], u.k)
        elif cfg.scope == "global":
            g = gathered[u.uid]                               # (W, B, width)
            allsc = jnp.moveaxis(g, 0, 1).reshape((u.layout.batch, g.shape[0] * u.seg.width))
            requests[u.uid] = (allsc, u.k)
        else:
            requests[u.uid] = (scores[u.uid], u.pick)
    tops = dict(zip(requests, _selection.batched_top_rows(list(requests.values()))))
    idx: dict[int, jax.Array] = {}
    payload: dict[int, jax.Array] = {}
    sq_norm: dict[int, jax.Array] = {}
    for u in units:
        m = mblk[u.leaf][u.block]
        ra = u.layout.row_axis
        if u.full:
            payload[u.uid] = m
            continue
        if u.mode != "rows":
            i = jnp.sort(tops[u.uid], axis=1)   # ascending rows: local gathers (polar is
            idx[u.uid] = i                        # row-permutation equivariant)
            payload[u.uid] = _selection.gather_rows(m, i, ra)
            if (u.leaf, u.block) in rows_sq:
                sq_norm[u.uid] = _selection.selected_sq_norm(rows_sq[(u.leaf, u.block)], i)
            continue
        seg, width = u.seg, u.seg.width
        start, cnt = pos[u.uid]
        if cfg.scope == "global":
            w = gathered[u.uid].shape[0]
            gi = tops[u.uid]
            sel = jax.vmap(lambda i: jnp.zeros((w * width,), bool).at[i].set(True))(gi)
            mine = jax.lax.dynamic_slice_in_dim(sel, shard_index(u) * width, width, axis=1)
            order = jnp.where(mine, -jnp.arange(width), -width - jnp.arange(width))
            li = _selection.top_rows(order.astype(jnp.float32), u.pick)
            valid = jnp.take_along_axis(mine, li, axis=1)
        else:
            li = tops[u.uid]
            valid = jnp.take_along_axis(scores[u.uid], li, axis=1) > -jnp.inf
        n_local = m.shape[ra]
        rows = start + li
        rows = jnp.where(valid, rows, n_local + jnp.arange(u.pick))   # distinct, dropped
        rows = jnp.sort(rows, axis=1)               # ascending; the padding rows come last
        valid = rows < n_local
        idx[u.uid] = rows
        s = _selection.gather_rows(m, jnp.minimum(rows, n_local - 1), ra)
        payload[u.uid] = s * jnp.expand_dims(valid, 3 - ra).astype(s.dtype)

    # 3. Megabatch: group payloads, average them over the replicas (compressed sync), one
    #    collective per group each way around the batched orthogonalizer call.
    gkeys, swaps = [], []
    for u in units:
        s = payload[u.uid]
        rows_asm = u.pick * (ctx.size(u.comm) if u.mode == "rows" else 1)
        # Wide orientation for the polar; a square matrix keeps its layout (polar(Xᵀ) = polar(X)ᵀ,
        # so a transpose there would only move memory).
        want = (u.layout.row_axis if rows_asm == u.layout.c
                else 1 if rows_asm < u.layout.c else 2)
        swap = u.layout.row_axis != want
        shape = _orient(s, swap).shape[1:]
        if u.mode == "local":
            kind = "split" if u.split else "local"
            gk = _megabatch.GroupKey(kind, u.comm if u.split else (), 0, shape,
                                     jnp.dtype(s.dtype), _megabatch.group_leaf(u.leaf))
        else:
            concat = want if u.mode == "rows" else 3 - want
            gk = _megabatch.GroupKey("a2a", u.comm, concat, shape, jnp.dtype(s.dtype),
                                     _megabatch.group_leaf(u.leaf))
        gkeys.append(gk)
        swaps.append(swap)
    synced: dict[int, jax.Array] = {}
    ortho: dict[int, jax.Array] = {}
    for gk, members in _megabatch.group_plan(gkeys).items():
        parts = [_orient(payload[units[i].uid], swaps[i]) for i in members]
        sizes = [units[i].layout.batch for i in members]
        if gk.kind == "local" and stack_local:
            # One device's whole matrices: normalise each before stacking, so the group's batch
            # is written once, in the polar's compute dtype (no float32 stack).
            norms = [sq_norm.get(units[i].uid) for i in members]
            o = _megabatch.checked(
                lambda ps: cfg.orthogonalizer.stacked(ps, norms), parts)
            xs_list = parts
        else:
            x = _megabatch.stack(parts)
            if ctx.compressed:
                x = jax.lax.pmean(x, replica)
            o = _megabatch.orthogonalize_group(x, gk, ctx.size(gk.axes), cfg.orthogonalizer)
            xs_list = _megabatch.unstack(x, sizes)
        for i, xs, os_ in zip(members, xs_list, _megabatch.unstack(o, sizes)):
            synced[units[i].uid] = _orient(xs, swaps[i])
            ortho[units[i].uid] = _orient(os_, swaps[i])

    # 4. Error feedback: only the selected rows decay (M[I] ← μ·S, S averaged over replicas).
    #    Rows go back with a gather and a select (expand_rows), not a scatter: one dense pass.
    row_pos = {u.uid: _selection.row_positions(idx[u.uid], mblk[u.leaf][u.block].shape[
        u.layout.row_axis]) for u in units if not u.full}
    for u in units:
        m = mblk[u.leaf][u.block]
        dec = (mu * synced[u.uid]).astype(m.dtype)
        if u.full:
            mblk[u.leaf][u.block] = dec
        else:
            mblk[u.leaf][u.block] = _selection.expand_rows(dec, row_pos[u.uid], u.layout.row_axis,
                                                           base=m)

    # 5. NorMuon normalisation (per whole matrix; partial sums all-reduced over the shards).
    dirs: dict[int, jax.Array] = {}
    if normuon:
        items, stats = [], {}
        for u in units:
            ra = u.layout.row_axis
            o = ortho[u.uid].astype(jnp.float32)
            row_sq = jnp.sum(jnp.square(o), axis=3 - ra)                 # (B, pick)
            v = vblk[u.leaf][u.block]
            v_sel = v if u.full else _selection.gather_rows(
                v, jnp.minimum(idx[u.uid], v.shape[ra] - 1), ra)
            stats[u.uid] = (o, jnp.squeeze(v_sel.astype(jnp.float32), 3 - ra))
            items.append((row_sq, u.comm if u.mode == "cols" else ()))
        row_sqs = _batched_psum(items)
        items2 = []
        for u, row_sq in zip(units, row_sqs):
            o, v_sel = stats[u.uid]
            beta2 = jnp.asarray(cfg.beta2, jnp.float32)
            v_new = beta2 * v_sel + (1.0 - beta2) * (row_sq / u.layout.c)
            a = jnp.sqrt(v_new) + NORMUON_EPS
            fro = jnp.stack([jnp.sum(row_sq, axis=1), jnp.sum(row_sq / jnp.square(a), axis=1)])
            stats[u.uid] = (o, v_new, a)
            items2.append((fro, u.comm if u.mode == "rows" else ()))
        fros = _batched_psum(items2)
        for u, fro in zip(units, fros):
            o, v_new, a = stats[u.uid]
            ra = u.layout.row_axis
            factor = jnp.sqrt(fro[0]) / jnp.maximum(jnp.sqrt(fro[1]), NORMUON_EPS)
            dirs[u.uid] = o * (jnp.expand_dims(1.0 / a, 3 - ra) * factor[:, None, None])
            v = vblk[u.leaf][u.block]
            v_new = jnp.expand_dims(v_new, 3 - ra)
            if u.full:
                vblk[u.leaf][u.block] = v_new.astype(v.dtype)
            else:
                vblk[u.leaf][u.block] = _selection.scatter_rows(v, idx[u.uid], v_new, ra,
                                                                mode="drop")
    else:
        for u in units:
            dirs[u.uid] = ortho[u.uid].astype(jnp.float32)

    # 6. Scatter the scaled directions into zero updates; back to leaves.
    ublk = [[None] * len(p.local.blocks) for p in plans]
    for u in units:
        d = lr_scale(cfg.adjust_lr, u.layout.n, u.layout.c) * dirs[u.uid]
        if u.full:
            ublk[u.leaf][u.block] = d
            continue
        ublk[u.leaf][u.block] = _selection.expand_rows(d, row_pos[u.uid], u.layout.row_axis,
                                                       base=ublk[u.leaf][u.block])
    new_u, new_m, new_v = [], [], []
    for p, g, m, v, ub, mb, vb in zip(plans, grads, moms, vars_, ublk, mblk, vblk):
        new_u.append(p.local.from_blocks(ub, g.shape).astype(g.dtype))
        new_m.append(p.local.from_blocks(mb, m.shape).astype(m.dtype))
        if normuon:
            new_v.append(p.local.from_blocks(vb, v.shape).astype(v.dtype))
    return new_u, new_m, new_v


def _zeros(shape, dtype, ref, spec, ctx: _distributed.Context) -> jax.Array:
    """Zeros placed like ``ref``'s mesh with ``spec`` (state leaves keep the params' layout)."""
    if not ctx.distributed:
        if isinstance(ref, jax.Array) and not isinstance(ref, jax.core.Tracer):
            return jnp.zeros(shape, dtype, device=ref.sharding) if len(
                ref.sharding.device_set) == 1 else jnp.zeros(shape, dtype)
        return jnp.zeros(shape, dtype)
    sharding = getattr(ref, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding) and not isinstance(ref, jax.core.Tracer):
        return jnp.zeros(shape, dtype, device=jax.sharding.NamedSharding(sharding.mesh, spec))
    if ctx.concrete_mesh is not None and not isinstance(ref, jax.core.Tracer):
        return jnp.zeros(shape, dtype,
                         device=jax.sharding.NamedSharding(ctx.concrete_mesh, spec))
    z = jnp.zeros(shape, dtype)
    if ctx.auto():
        return jax.lax.with_sharding_constraint(z, spec)
    return jax.sharding.reshard(z, spec)


def scale_by_dion3(
    fraction: float = 0.25,
    mu: jax.typing.ArrayLike = 0.95,
    beta2: jax.typing.ArrayLike = 0.95,
    *,
    flavour: Flavour = "normuon",
    adjust_lr: AdjustLR = "spectral_norm",
    dimension_numbers: Any = None,
    num_heads: Any = None,
    split_sizes: Any = None,
    mu_dtype: jax.typing.DTypeLike | None = None,
    orthogonalizer: Callable[[jax.Array], jax.Array] | None = None,
    method: Literal["gram", "standard"] = "gram",
    coefficients: str | Sequence[Sequence[float]] = "polar_express",
    restarts: Sequence[int] = (2,),
    compute_dtype: jax.typing.DTypeLike | None = None,
    backend: Literal["auto", "xla", "mosaic", "triton"] = "auto",
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
    shard_axis: str | Sequence[str] | None = None,
    replica_axis: str | None = None,
    selection_scope: Literal["local", "global"] = "local",
    replica_selection: Literal["random", "norms"] = "random",
    seed: int | None = None,
    param_specs: Any = None,
) -> optax.GradientTransformation:
    r"""Dion3's orthogonal update direction for matrix parameters (before learning rate and decay).

    Every leaf of the tree it sees must be a matrix (rank ≥ 2; use :func:`dion3_jax.dion3` to
    route the other leaves to AdamW). See the module docstring for the per-step rule. With
    ``fraction=1`` every row is selected every step and the rule is Muon / NorMuon with momentum
    ``U_t = μ·U_{t−1} + G_t`` (no Nesterov).

    Args:
      fraction: static fraction ``f`` in ``(0, 1]`` of rows orthogonalized per step; each matrix
        selects ``k = max(1, ceil(f·n))`` of its ``n`` output rows. Not injectable (it fixes
        shapes): with ``optax.inject_hyperparams`` list it in ``static_args``.
      mu: error-feedback decay of the selected rows (the momentum coefficient at ``f = 1``).
      beta2: EMA coefficient of the NorMuon per-row second moment.
      flavour: ``"normuon"`` (row-normalised, the Dion3 default) or ``"muon"`` (plain polar).
      adjust_lr: per-matrix shape factor: ``"spectral_norm"`` (√(fan_out/fan_in)),
        ``"rms_norm"`` (0.2·√max(fan_out, fan_in), AdamW-compatible learning rates) or ``None``.
        Computed from the full matrix (per head with ``num_heads``, per block with
        ``split_sizes``), never from the selected rows.
      dimension_numbers: :class:`dion3_jax.DimensionNumbers` ``(reduction_axis, output_axis)``
        as one value for all leaves, a tree (or prefix tree) like the params, or a callable
        ``params -> tree``. Default: the last two axes are ``(in, out)`` (Flax kernels); other
        axes are batch axes.
      num_heads: per-head matrices (one int, a tree or a callable, like ``dimension_numbers``).
      split_sizes: independent row blocks of the output axis, e.g. fused QKV (a tuple of ints,
        a tree or a callable).
      mu_dtype: dtype of the momentum (default: each param's dtype).
      orthogonalizer: callable mapping a ``(batch, rows, cols)`` array to its polar factors;
        defaults to :func:`dion3_jax.polar` with the arguments below.
      method, coefficients, restarts, compute_dtype, backend: passed to :func:`dion3_jax.polar`
        when ``orthogonalizer`` is None.
      mesh: the device mesh. Default: the ambient one (``jax.set_mesh``), else the mesh of the
        leaves' shardings; none → the single-device path. Under ``jit`` with a mesh, the step
        runs in one ``jax.shard_map`` over every mesh axis that is not already manual, and each
        leaf keeps its sharding (see ``docs/DISTRIBUTED.md``). A leaf may be sharded along one
        axis: its output axis ("rows"), its reduction axis ("cols"), a batch axis (whole
        matrices per device), or replicated (the group's batch is split across ``shard_axis``
        and all-gathered). Matrices of the same shape go through ONE all-to-all each way.
      shard_axis: the FSDP mesh axis or axes (a name or a tuple); replicated matrices are split
        across them. Default: every mesh axis except ``replica_axis`` and manual axes.
      replica_axis: the slow data-parallel axis (e.g. ``"dcn"``), or None. Parameters must be
        replicated over it. When ``update`` is called inside a ``jax.shard_map`` that makes it
        manual, gradients are per replica (not all-reduced) and only the selected rows
        ``M[I, :]`` are averaged over it (compressed sync); see
        :func:`dion3_jax.synchronize_momentum`.
      selection_scope: on row-sharded matrices, ``"local"`` (each shard selects its own
        ``ceil(f·ceil(n/W))`` rows; only those travel) or ``"global"`` (exact top-k of the whole
        matrix; the result does not depend on the mesh). Elsewhere both are exact.
      replica_selection: with ``replica_axis``: ``"random"`` (row set from a PRNG key shared by
        the replicas; the update equals the fully synchronised one exactly) or ``"norms"``
        (top-k of the row ℓ1 norms summed over replicas; only the norms are all-reduced).
      seed: int seed of the ``"random"`` replica selection (default ``None`` = 0). Static: with
        ``optax.inject_hyperparams`` an explicit seed must be listed in ``static_args``.
      param_specs: the leaves' ``PartitionSpec`` s (one spec, a tree or a callable), needed
        when mesh axes are Auto (the traced shardings are unknown then); default under Auto:
        each leaf sharded over ``shard_axis`` along its first divisible axis. Under Explicit
        axes the shardings are read from the leaves' types.

    Returns:
      An ``optax.GradientTransformation`` with state :class:`ScaleByDion3State`.

    Raises:
      ValueError: for an invalid hyperparameter or distribution option (at construction), a
        leaf that is not a matrix, an unsupported sharding or a mesh axis that does not exist
        (at init / update).

    References:
      Amsel et al., `Dion3: Full-Stack Orthogonal Updates <https://arxiv.org/abs/2608.11612>`_,
      2026.
    """
    fraction = check_fraction(fraction)
    check_range("mu", mu, 0.0, 1.0)
    check_range("beta2", beta2, 0.0, 1.0, hi_open=True)
    if flavour not in _FLAVOURS:
        raise ValueError(f"flavour must be one of {_FLAVOURS}, got {flavour=!r}")
    if adjust_lr not in _ADJUST:
        raise ValueError(f"adjust_lr must be one of {_ADJUST}, got {adjust_lr=!r}")
    try:
        mu_dtype = optax._src.utils.canonicalize_dtype(mu_dtype)
    except TypeError as e:
        raise ValueError(f"mu_dtype must be a dtype or None, got {mu_dtype=!r}") from e
    if mu_dtype is not None and not jnp.issubdtype(mu_dtype, jnp.floating):
        raise ValueError(f"mu_dtype must be a floating dtype, got {mu_dtype=!r}")
    if (dimension_numbers is not None and not callable(dimension_numbers)
            and _layout.is_single_value(dimension_numbers)
            and not hasattr(dimension_numbers, "reduction_axis")):
        raise ValueError("dimension_numbers must be a DimensionNumbers, a tree of them or a "
                         f"callable, got {dimension_numbers=!r}")
    if orthogonalizer is None:
        # The step casts the polar factors to float32 itself: taking them in the compute dtype
        # writes no float32 copy, and the all-to-alls send them back at half the bytes.
        orthogonalizer = make_orthogonalizer(
            method=method, coefficients=coefficients, restarts=tuple(restarts),
            compute_dtype=compute_dtype, backend=backend,
            out_dtype=resolved_compute_dtype(method, compute_dtype))
    elif not callable(orthogonalizer):
        raise ValueError(f"orthogonalizer must be callable, got {orthogonalizer=!r}")
    if not callable(num_heads) and _layout.is_single_value(num_heads):
        _layout.check_num_heads(num_heads)
    if not callable(split_sizes) and _layout.is_single_value(split_sizes):
        _layout.check_split_sizes(split_sizes)
        if split_sizes is not None and isinstance(num_heads, int) and num_heads > 1:
            raise ValueError(f"num_heads and split_sizes cannot be combined, got {num_heads=} "
                             f"and {split_sizes=}")

    _distributed.check_options(mesh, shard_axis, replica_axis, selection_scope,
                               replica_selection, param_specs)
    if seed is None:
        seed = 0
    if _is_tracer(seed):
        raise ValueError("seed must be a static int; with optax.inject_hyperparams pass "
                         "static_args=('seed', ...)")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an int, got {seed=!r}")
    cfg = _StepConfig(fraction, mu, beta2, flavour, adjust_lr, selection_scope,
                      replica_selection, seed, orthogonalizer)

    def plan(tree):
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
        leaves = [leaf for _, leaf in flat]
        ctx = _distributed.resolve_context(mesh, shard_axis, replica_axis, leaves)
        dn = _layout.per_leaf(dimension_numbers, tree)
        nh = _layout.per_leaf(num_heads, tree)
        ss = _layout.per_leaf(split_sizes, tree)
        if ctx.distributed:
            specs = _distributed.leaf_specs(ctx, leaves, param_specs, tree)
        else:
            specs = [((),) * len(leaf.shape) for leaf in leaves]
        plans = [_distributed.make_plan(ctx, spec, tuple(leaf.shape), dn(path), nh(path),
                                        ss(path), _layout.path_str(path))
                 for (path, leaf), spec in zip(flat, specs)]
        return leaves, plans, treedef, ctx

    def init_fn(params):
        leaves, plans, treedef, ctx = plan(params)
        mom, var = [], []
        for p, pl in zip(leaves, plans):
            mom.append(_zeros(p.shape, mu_dtype or p.dtype, p, pl.spec, ctx))
            if flavour == "normuon":
                var.append(_zeros(pl.layout.variance_shape, jnp.float32, p, pl.var_spec, ctx))
        return ScaleByDion3State(
            count=jnp.zeros([], jnp.int32), momentum=treedef.unflatten(mom),
            variance=treedef.unflatten(var) if flavour == "normuon" else None)

    def update_fn(updates, state, params=None):
        del params
        grads, plans, treedef, ctx = plan(updates)
        moms = treedef.flatten_up_to(state.momentum)
        vars_in = treedef.flatten_up_to(state.variance) if flavour == "normuon" else []
        units = _make_units(plans, fraction, selection_scope, ctx)

        def step(g, m, v, count):
            vv = v if flavour == "normuon" else [None] * len(g)
            return _step(cfg, ctx, plans, units, g, m, vv, count)

        if ctx.distributed:
            specs = [pl.spec for pl in plans]
            vspecs = [pl.var_spec for pl in plans] if flavour == "normuon" else []
            fn = _distributed.shard_map(ctx, step, in_specs=(specs, specs, vspecs, jax.P()),
                                        out_specs=(specs, specs, vspecs))
            new_u, new_m, new_v = fn(list(grads), list(moms), list(vars_in), state.count)
        else:
            new_u, new_m, new_v = step(list(grads), list(moms), list(vars_in), state.count)
        new_state = ScaleByDion3State(
            count=optax.safe_increment(state.count), momentum=treedef.unflatten(new_m),
            variance=treedef.unflatten(new_v) if flavour == "normuon" else None)
        return treedef.unflatten(new_u), new_state

    return optax.GradientTransformation(init_fn, update_fn)
