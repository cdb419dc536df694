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
"""The traced Dion3 step: a pipeline of named phases over the static plan.

Per device (inside the transform's ``shard_map``, or directly on one device)::

    accumulate_and_score → select → gather_and_send → megabatched_polar
        → row_sources → error_feedback → normalize → scatter_and_apply

The momentum travels as ``(M, d)``: the momentum is ``d ⊙ M`` with ``d`` one factor per row, so
that a step can defer its selected rows' decay to the next one's ``S = d ⊙ M + G``
(:func:`error_feedback`).

Each phase reads the :class:`dion3_jax._plan.Plan` (never the config: the plan holds every option
the step consults; ``mu`` and ``beta2`` come as :class:`Coefficients`, since they may be traced)
and passes named tuples to the next; per-unit values are tuples indexed by ``Unit.uid``. The
per-matrix maths lives in ``_rules``; the selection primitives in ``_selection``; the grouped
collectives in ``_megabatch`` and ``_collectives``. The small per-matrix work (row positions,
NorMuon) runs once per :class:`dion3_jax._plan.Batch` on its members stacked, so the traced
program does not grow by those operations with every matrix of a shape.
"""

from __future__ import annotations

import collections
from typing import Any, NamedTuple, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from dion3_jax import _megabatch, _norms, _rounding, _rules, _selection, _storage
from dion3_jax._collectives import batched_all_gather, batched_psum, nontrivial, replica_mean
from dion3_jax._plan import Plan, Unit

#: What the payload pass of a group whose every row is selected (``full``) or of selected rows
#: runs for each ``pass_implementation``: ``"mosaic"`` has a kernel for every row only, and
#: selected rows go to XLA (as fast as the Pallas-Triton kernel in the 7B-shapes step at
#: f = 1/4, docs/KERNELS.md).
PAYLOAD_IMPLEMENTATION: dict[str, tuple[pallas_kernels._payload.PayloadImplementation, ...]] = {
    "auto": ("auto", "auto"), "xla": ("xla", "xla"), "mosaic": ("mosaic", "xla"),
    "pallas_triton": ("pallas_triton", "pallas_triton")}

Blocks = list[list[jax.Array]]
_T = TypeVar("_T")


def _some(x: _T | None) -> _T:
    """``x``, which the plan guarantees is there (a value that is optional by route: a unit's
    scores when it selects, a pick's rows on a row shard, ...); a ValueError if it is not."""
    if x is None:
        raise ValueError("the step read a value its plan said would be there")
    return x


def _filled(blocks: list[list[jax.Array | None]]) -> Blocks:
    """``blocks`` (per leaf, per block) once every slot has been written."""
    return [[_some(x) for x in b] for b in blocks]


class Accumulated(NamedTuple):
    """After ``M ← d ⊙ M + G``: the blocks, and per unit its row scores and row statistics."""

    momentum: Blocks                       # per leaf, per block: S = d ⊙ M + G
    variance: Blocks | None                # NorMuon second moments (None for Muon)
    scores: tuple[jax.Array | None, ...]   # (batch, candidate rows); None when every row goes
    positions: tuple[tuple | None, ...]    # "rows" units: this device's (start, count) rows
    row_sq: dict[tuple[int, int], jax.Array]  # (leaf, block) → _selection.row_sq_sums
    full_sq: dict[int, jax.Array]          # :func:`_payload_decays` units: _norms.sq_sum per matrix
    one_pass: frozenset[int]               # :func:`_one_pass_groups`: S from the kernel


class Pick(NamedTuple):
    """One unit's selection on this device."""

    rows: jax.Array | None      # (batch, pick) ascending local row indices (≥ n_local: padding)
    payload: jax.Array | None   # S[I], (batch, pick, C) in the block's orientation; None
                                # where the payload pass gathers (``Accumulated.one_pass``)
    sq_sum: jax.Array | None    # full and row-segment units: this device's part of
                                # Σ (S·2⁻³²)² per matrix (_norms); global-scope row segments:
                                # per picked row, (batch, pick), each in a fixed order
                                # (_selection.selected_row_sq_sums); others: _batch_sq_sums
    counts: jax.Array | None = None  # global-scope row segments: (batch, W) selected rows
                                     # per device (_selection.rows_per_device)


class Polar(NamedTuple):
    """One unit's selected rows as orthogonalized (replica-averaged under compressed sync)."""

    selected: jax.Array | None  # S (mean over replicas), the block's orientation; None after
                                # a one-pass payload (only compressed sync reads it)
    factors: jax.Array          # O = polar(S), this device's rows / columns


class BatchFactors(NamedTuple):
    """A batch's members' polar factors as one array: a static slice of its group's result."""

    factors: jax.Array          # (batch, a, b), the group's orientation
    row_axis: int               # the members' row axis in that orientation


def _shard_index(u: Unit):
    return jax.lax.axis_index(u.comm) if u.comm else 0


def _orient(x: jax.Array, swap: bool) -> jax.Array:
    return jnp.swapaxes(x, 1, 2) if swap else x


def _l1_scores(plan: Plan, local: dict) -> dict[tuple[int, int], jax.Array]:
    """Row ℓ1 norms per (leaf, block) (``local``: this device's, :func:`_row_stats`), summed over
    column shards (and replicas under "norms")."""
    replica = (plan.ctx.replica_axis,) if plan.norms_over_replicas else ()
    units = {(u.leaf, u.block): u for u in reversed(plan.units)}
    keys = list(local)
    return dict(zip(keys, batched_psum([
        (local[k], units[k].col_axes + replica)
        for k in keys])))


def _segment_scores(plan: Plan, u: Unit, raw, count):
    """Scores of a "rows" unit over its segment's ``width`` local rows; absent rows are −inf."""
    seg, d = u.segment, _shard_index(u)
    start, cnt = _selection.local_positions(seg.start, seg.count, seg.width, d)
    if not plan.random_selection:
        shifted = any(s != 0 for s in seg.start)
        return _selection.segment_scores(raw[(u.leaf, u.block)], start, cnt, seg.width,
                                         shifted), (start, cnt)
    seed = plan.seed
    if not plan.global_scope:
        r = _selection.random_scores(seed, count, u.uid, (u.layout.batch, seg.width), d)
    else:
        w = plan.ctx.size(u.comm)
        r = _selection.random_scores(seed, count, u.uid, (u.layout.batch, w * seg.width))
        r = jax.lax.dynamic_slice_in_dim(r, d * seg.width, seg.width, axis=1)
    valid = jnp.arange(seg.width) < cnt
    return jnp.where(valid[None], r, -jnp.inf), (start, cnt)


def _payload_decays(plan: Plan, u: Unit) -> bool:
    """Whether ``u`` is a full unit whose payload the step normalizes itself (the built-in
    orthogonalizer, no replica averaging): then its payload ``S/‖S‖`` comes from one read of
    ``S`` after the norm, and its decay is left to the next step (see :func:`_accumulate`)."""
    return u.full and plan.send_normalized and u.group.route in ("on_device", "all_to_all")


def _payload_selects(plan: Plan, u: Unit) -> bool:
    """Whether ``u`` selects rows and its payload ``S[I]/‖S[I]‖`` comes from one read of ``S``
    like :func:`_payload_decays` units': the payload in its group's orientation, its norm known
    from the row statistics."""
    return (not u.full and plan.send_normalized and u.group.route in ("on_device", "all_to_all")
            and not u.swap and u.uid in plan.row_norm_uids)


def _local_shape(plan: Plan, u: Unit) -> tuple[int, int, int]:
    return plan.leaves[u.leaf].local.blocks[u.block].shape


def _one_pass_groups(plan: Plan) -> frozenset[int]:
    """The units of the groups whose payloads come from :func:`_one_pass_payloads`: all their
    members are full :func:`_payload_decays` units, or all :func:`_payload_selects` units of one
    row axis and one block shape, each the only unit of its block (row segments of one block
    decay their rows in turn)."""
    blocks = collections.Counter((u.leaf, u.block) for u in plan.units)
    out: set[int] = set()
    for _, uids in plan.groups:
        units = [plan.units[i] for i in uids]
        if (all(_payload_decays(plan, u) for u in units)
                or (all(_payload_selects(plan, u) and blocks[(u.leaf, u.block)] == 1
                        for u in units)
                    and len({u.layout.row_axis for u in units}) == 1
                    and len({_local_shape(plan, u)[1:] for u in units}) == 1)):
            out.update(uids)
    return frozenset(out)


def _row_stats(plan: Plan, momentum: Blocks, known: dict, one_pass: frozenset[int]
               ) -> tuple[dict, dict]:
    """Per (leaf, block): this device's row ℓ1 norms (the selection scores before their
    all-reduce; none under random selection), and :func:`_selection.row_sq_sums` of the blocks
    whose payload norms come from them (and of the ``one_pass`` units'); ``known``: the blocks
    whose two sums the statistics kernel gave (:func:`_accumulate`)."""
    l1, sq = {}, {}
    for u in plan.units:
        key = (u.leaf, u.block)
        if key in known:
            l1[key], sq[key] = known[key]
            continue
        if not (u.full or plan.random_selection or key in l1):
            l1[key] = _selection.row_l1_norms(momentum[u.leaf][u.block], u.layout.row_axis)
        if (u.uid in plan.row_norm_uids or u.uid in one_pass) and key not in sq:
            sq[key] = _selection.row_sq_sums(momentum[u.leaf][u.block], u.layout.row_axis)
    return l1, sq


def _summed_partials(partials: dict) -> dict:
    """The statistics kernel's ``(batch, chunks, n)`` partial row sums per (leaf, block), added
    over their chunks in one reduction per partials shape (the blocks of a shape group): XLA
    fuses that reduction into the sums' readers, where one per block would be a launch of its
    own, two per matrix. The sums are cut back into blocks by static slices: the run-time
    offsets of :func:`_megabatch.unstack` left 4 more passes in the step compiled for an H200
    (``benchmarks/gpu_hlo.py``, f = 1/4 and 1/8)."""
    groups: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for key, pair in partials.items():
        groups.setdefault(pair[0].shape[1:], []).append(key)
    out = {}
    for keys in groups.values():
        sums = [jnp.sum(_megabatch.stack([partials[k][i] for k in keys]), axis=1)
                for i in (0, 1)]
        lo = 0
        for k in keys:
            hi = lo + partials[k][0].shape[0]
            out[k] = (sums[0][lo:hi], sums[1][lo:hi])
            lo = hi
    return out


def _write_keys(plan: Plan, dtypes, count, write: int) -> jax.Array | None:
    """Every leaf's key of ``write`` at step ``count`` (:func:`_rounding.step_keys`, one batched
    hash), or None where no momentum of ``dtypes`` is rounded stochastically."""
    if not any(_rounding.stochastic(t) for t in dtypes):
        return None
    return _rounding.step_keys(plan.seed, count, write, len(plan.leaves))


def _momentum_bits(plan: Plan, dtypes, keys: jax.Array | None) -> list[jax.Array | None]:
    """Per leaf (``dtypes``: its momentum's), the random bits of a 16-bit momentum's stochastic
    rounding under its key in ``keys`` (:func:`_write_keys`), in the local shard's shape
    (:mod:`dion3_jax._rounding`); None for other dtypes (rounded to nearest)."""
    return [_rounding.momentum_bits(_some(keys)[i], p.local.shape, p.spec)
            if _rounding.stochastic(t) else None
            for i, (p, t) in enumerate(zip(plan.leaves, dtypes))]


def _statistics_kernel(plan: Plan, u: Unit, dtype, keys, counters: dict, words: dict
                       ) -> bool:
    """Whether unit ``u``'s statistics pass runs in a kernel (its momentum of ``dtype``); for a
    16-bit momentum, only with its block's counter under its leaf's key in ``keys``
    (:func:`_write_keys`), which this puts in ``counters`` (keyed ``(leaf, block)``;
    :func:`_rounding.block_counters`, made only where a kernel runs; ``words`` keeps their
    :func:`_rounding.block_words` per layout). A named kernel that cannot take the unit raises
    a ``ValueError`` that names the leaf."""
    stochastic = _rounding.stochastic(dtype)
    shape, ra = _local_shape(plan, u)[1:], u.layout.row_axis
    try:
        if pallas_kernels.accumulate_rows_implementation(
                shape, ra, plan.pass_implementation) == "xla":
            return False
        if not stochastic:
            return True
        p = plan.leaves[u.leaf]
        layout = (p.local, p.spec)
        if layout not in words:       # made once for all leaves of one layout
            words[layout] = _rounding.block_words(p.local, p.spec)
        counter = _rounding.block_counters(keys, p.local, p.spec, words[layout],
                                           leaf=u.leaf)[u.block]
        if counter is None and plan.pass_implementation != "auto":
            raise ValueError(f"implementation={plan.pass_implementation!r} needs random bits "
                             f"that step evenly along each row of the {shape} blocks (a "
                             f"reduction axis merged across a sharded axis does not); use 'xla'")
        counters[(u.leaf, u.block)] = counter
        return counter is not None
    except ValueError as e:
        name = plan.names[u.leaf] if plan.names else f"leaf {u.leaf}"
        raise ValueError(f"{name} ({jnp.dtype(dtype).name} momentum): {e}") from None


def _accumulate(plan: Plan, grads, moms, scales, count, out_scales):
    """``S = d ⊙ M + G`` per block (``d``: the per-row factors ``scales``, the decay that the
    step before left), its row statistics (:func:`_row_stats`), the :func:`_payload_decays`
    units' sums of squares and the :func:`_one_pass_groups` units.

    The one-pass units' blocks go through :func:`pallas_kernels.accumulate_rows`: one pass over
    ``M`` and ``G`` writes ``S`` in place of ``M`` with both row sums. Their payloads then read
    ``S`` alone, and their selected rows' decay is not written this step (:func:`error_feedback`).
    Where that pass would run in XLA, and for the other blocks, ``S`` is summed in the leaf's
    own shape (which lets XLA write it in place of a donated momentum of any layout) and left
    to XLA to fuse into its readers. A 16-bit momentum is rounded stochastically (random bits
    of the step ``count``, :func:`_momentum_bits`); the kernels hash the same bits themselves
    from the blocks' counters (:func:`_rounding.block_counters`). ``out_scales``: per leaf, the
    write scale ``c`` of a float16 momentum (:func:`_write_scales`), or None: ``S`` is written
    as ``c·(d ⊙ M + G)``.

    Returns:
      ``(S blocks, full sums, (ℓ1, row_sq), one-pass units)``.
    """
    one_pass = _one_pass_groups(plan)
    counters: dict = {}
    words: dict = {}
    keys = _write_keys(plan, [m.dtype for m in moms], count, _rounding.SUM)
    kernel = {(u.leaf, u.block): u for u in (plan.units[i] for i in one_pass)
              if _statistics_kernel(plan, u, moms[u.leaf].dtype, keys, counters, words)}
    in_xla = [any((i, b) not in kernel for b in range(len(p.local.blocks)))
              for i, p in enumerate(plan.leaves)]
    # (Bits only for the leaves summed here: the kernels hash their own.)
    bits = _momentum_bits(plan, [m.dtype if x else jnp.float32 for m, x in zip(moms, in_xla)],
                          keys)
    momentum: list[list[jax.Array | None]] = [
        list(p.local.to_blocks(pallas_kernels.scaled_sum(m, g, d, r, c))) if x
        else [None] * len(p.local.blocks)
        for p, m, g, d, r, c, x in zip(plan.leaves, moms, grads, scales, bits, out_scales,
                                       in_xla)]
    partials = {}
    for (leaf, block), u in kernel.items():
        local, ra = plan.leaves[leaf].local, u.layout.row_axis
        m, g, d = (local.to_blocks(x)[block] for x in (moms[leaf], grads[leaf], scales[leaf]))
        s, l1, sq = pallas_kernels.accumulate_rows(m, g, jnp.squeeze(d, 3 - ra), row_axis=ra,
                                                   implementation=plan.pass_implementation,
                                                   partial_sums=True,
                                                   counter=counters.get((leaf, block)),
                                                   out_scale=out_scales[leaf])
        momentum[leaf][block] = s
        partials[(leaf, block)] = (l1, sq)
    known = _summed_partials(partials)
    filled = _filled(momentum)
    # (The kernel's full units take their sums from the row sums, once per batch.)
    full_sq = {u.uid: _norms.sq_sum(filled[u.leaf][u.block].astype(jnp.float32), (1, 2))
               for u in plan.units if _payload_decays(plan, u) and u.uid not in one_pass}
    return filled, full_sq, _row_stats(plan, filled, known, one_pass), one_pass


def accumulate_and_score(plan: Plan, grads, moms, vars_, scales, count, out_scales
                         ) -> Accumulated:
    """``M ← d ⊙ M + G`` per block (:func:`_accumulate`; ``out_scales``: :func:`_write_scales`);
    the row statistics and each unit's selection scores."""
    momentum, full_sq, (l1, row_sq), one_pass = _accumulate(plan, grads, moms, scales, count,
                                                            out_scales)
    variance = ([p.local.to_blocks(v) for p, v in zip(plan.leaves, vars_)]
                if plan.normuon else None)
    raw = {} if plan.random_selection else _l1_scores(plan, l1)
    scores, positions = [], []
    for u in plan.units:
        s, pos = None, None
        if u.full:
            pass
        elif u.shard == "rows":
            s, pos = _segment_scores(plan, u, raw, count)
        elif plan.random_selection:
            fold = _shard_index(u) if (u.shard == "whole" and not u.split and u.comm) else None
            s = _selection.random_scores(plan.seed, count, u.uid, (u.layout.batch, u.layout.n),
                                         fold)
        else:
            s = raw[(u.leaf, u.block)]
        scores.append(s)
        positions.append(pos)
    return Accumulated(momentum, variance, tuple(scores), tuple(positions), row_sq, full_sq,
                       one_pass)


def _top_k_requests(plan: Plan, acc: Accumulated) -> dict[int, tuple]:
    """Per unit that selects, its ``(scores, k)`` top-k request; global scope on row shards
    gathers every device's scores first (n floats per matrix)."""
    gathered = {}
    if plan.global_scope:
        sel = [u for u in plan.units if u.shard == "rows" and not u.full]
        for u, g in zip(sel, batched_all_gather([(_some(acc.scores[u.uid]), u.comm)
                                                 for u in sel])):
            gathered[u.uid] = g                               # (W, batch, width)
    requests = {}
    for u in plan.units:
        if u.full:
            continue
        if u.shard != "rows":
            requests[u.uid] = (acc.scores[u.uid], u.k)
        elif plan.global_scope:
            g = gathered[u.uid]
            allsc = jnp.moveaxis(g, 0, 1).reshape((u.layout.batch, g.shape[0] * u.segment.width))
            requests[u.uid] = (allsc, u.k)
        else:
            requests[u.uid] = (acc.scores[u.uid], u.pick)
    return requests


def _mine_of_global(u: Unit, top: jax.Array, devices: int):
    """Global scope: this device's local picks among the global top-k (first ``pick``)."""
    width = u.segment.width
    sel = jax.vmap(lambda i: jnp.zeros((devices * width,), bool).at[i].set(True))(top)
    mine = jax.lax.dynamic_slice_in_dim(sel, _shard_index(u) * width, width, axis=1)
    order = jnp.where(mine, -jnp.arange(width), -width - jnp.arange(width))
    li = _selection.top_rows(order.astype(jnp.float32), u.pick)
    return li, jnp.take_along_axis(mine, li, axis=1)


def _pick_segment_rows(plan: Plan, u: Unit, m, top, scores, start, row_sums, gather: bool
                       ) -> Pick:
    """A "rows" unit's payload (with ``gather``; else None): its picked local rows, padding
    rows zeroed."""
    ra = u.layout.row_axis
    counts = None
    if plan.global_scope:
        li, valid = _mine_of_global(u, top, plan.ctx.size(u.comm))
        counts = _selection.rows_per_device(top, u.segment.width, plan.ctx.size(u.comm))
    else:
        li = top
        valid = jnp.take_along_axis(scores, li, axis=1) > -jnp.inf
    n_local = m.shape[ra]
    rows = jnp.where(valid, start + li, n_local + jnp.arange(u.pick))   # distinct, dropped
    rows = jnp.sort(rows, axis=1)               # ascending; the padding rows come last
    valid = rows < n_local
    clamped = jnp.minimum(rows, n_local - 1)
    if row_sums is None:
        sq = None
    elif counts is not None:    # the one-device bits per row, summed after the gather
        sq = jnp.where(valid, _selection.selected_row_sq_sums(m, clamped, ra), 0.0)
    else:
        sq = _selection.selected_sq_sum(row_sums, clamped, valid)
    if not gather:
        return Pick(rows, None, sq, counts)
    s = _selection.gather_rows(m, clamped, ra)
    return Pick(rows, s * jnp.expand_dims(valid, 3 - ra).astype(s.dtype), sq, counts)


def _sizes(plan: Plan, uids) -> list[int]:
    return [plan.units[i].layout.batch for i in uids]


def _batch_tops(plan: Plan, acc: Accumulated) -> dict[int, jax.Array]:
    """Per batch that selects (by index in ``plan.batches``), its members' top-k rows stacked
    along the batch axis, ascending per matrix: one ``top_k`` and one sort per distinct
    ``(n, k)`` of the model."""
    requests = _top_k_requests(plan, acc)
    sel = [j for j, b in enumerate(plan.batches) if b.uids[0] in requests]
    tops = _selection.batched_top_rows(
        [(_megabatch.stack([requests[i][0] for i in plan.batches[j].uids]),
          requests[plan.batches[j].uids[0]][1]) for j in sel], ascending=True)
    return dict(zip(sel, tops))


def _pick(plan: Plan, acc: Accumulated, u: Unit, top) -> Pick:
    """One unit's payload ``S = M[I]`` from its ascending top-k rows ``top``."""
    m = acc.momentum[u.leaf][u.block]
    row_sums = acc.row_sq.get((u.leaf, u.block))
    if u.full:
        return Pick(None, m, acc.full_sq.get(u.uid))
    if u.shard == "rows":
        return _pick_segment_rows(plan, u, m, top, acc.scores[u.uid],
                                  _some(acc.positions[u.uid])[0],
                                  row_sums, u.uid not in acc.one_pass)
    # Ascending rows: local gathers (the polar is row-permutation equivariant; none where the
    # payload pass gathers); the sums of squares of the selected rows come once per batch
    # (:func:`_batch_sq_sums`).
    payload = None if u.uid in acc.one_pass else _selection.gather_rows(m, top,
                                                                        u.layout.row_axis)
    return Pick(top, payload, None)


def _batch_sq_sums(plan: Plan, acc: Accumulated, b, top, picks) -> jax.Array | None:
    """The batch's payloads' (scaled) sums of squares, ``(batch,)``, or None where unknown:
    whole-matrix units take their selected rows' row statistics (one gather and one sum per
    batch; under global scope, their rows' sums in a fixed order added in value order), the
    others their :attr:`Pick.sq_sum`."""
    u = plan.units[b.uids[0]]
    if u.full and u.uid in acc.one_pass:     # the statistics kernel's row sums
        return _norms.total(_megabatch.stack([acc.row_sq[(plan.units[i].leaf,
                                                          plan.units[i].block)]
                                              for i in b.uids]), 1)
    if u.shard == "rows" or u.full or u.uid not in plan.row_norm_uids:
        sums = [picks[i].sq_sum for i in b.uids]
        return None if sums[0] is None else _megabatch.stack(sums)
    if plan.global_scope:
        return _norms.total_in_value_order(_global_row_sq_sums(plan, acc, b, picks), 1)
    row_sums = _megabatch.stack([acc.row_sq[(plan.units[i].leaf, plan.units[i].block)]
                                 for i in b.uids])
    return _selection.selected_sq_sum(row_sums, top)


def _global_row_sq_sums(plan: Plan, acc: Accumulated, b, picks) -> jax.Array:
    """Global scope: the batch's selected rows' sums of squares, ``(batch, k)``, each added in
    a fixed order from the gathered rows (:func:`_selection.selected_row_sq_sums`): the bits
    a mesh gets from its row shards."""
    return _megabatch.stack([
        _selection.selected_row_sq_sums(acc.momentum[plan.units[i].leaf][plan.units[i].block],
                                        picks[i].rows, plan.units[i].layout.row_axis)
        for i in b.uids])


def select(plan: Plan, acc: Accumulated
           ) -> tuple[tuple[Pick, ...], tuple[jax.Array | None, ...], tuple]:
    """Top-k rows per batch (one batched ``top_k`` per shape) and the payloads ``S = M[I]``.

    Returns:
      Per unit its :class:`Pick`; per batch its members' selected local rows stacked
      (``Pick.rows`` of each member), or None where every row goes; per batch its
      :func:`_batch_sq_sums`.
    """
    tops = _batch_tops(plan, acc)
    picks: list[Pick | None] = [None] * len(plan.units)
    rows: list[jax.Array | None] = [None] * len(plan.batches)
    sq_sums = []
    for j, b in enumerate(plan.batches):
        per_unit = (_megabatch.unstack(tops[j], _sizes(plan, b.uids)) if j in tops
                    else [None] * len(b.uids))
        for i, top in zip(b.uids, per_unit):
            picks[i] = _pick(plan, acc, plan.units[i], top)
        if j in tops:
            rows[j] = (tops[j] if plan.units[b.uids[0]].shard != "rows"
                       else _megabatch.stack([_some(_some(picks[i]).rows) for i in b.uids]))
        sq_sums.append(_batch_sq_sums(plan, acc, b, tops.get(j), picks))
    return tuple(picks), tuple(rows), tuple(sq_sums)  # type: ignore[arg-type]


class GroupBatch(NamedTuple):
    """A shape group's payloads, in the group's orientation, ready for its orthogonalizer call."""

    key: _megabatch.GroupKey
    uids: tuple[int, ...]
    parts: list[jax.Array] | None    # per member, (batch, a, b): the payloads S (None: one pass)
    norms: list[jax.Array | None]    # on-device groups: ‖S‖_F per matrix, if known already
    stacked: jax.Array | None        # what the collective sends: None for on-device groups
                                     # (one-pass ones: the stack, maybe padded past key.shape)
    normalized: bool                 # ``stacked`` is S/(‖S‖+ε) in the orthogonalizer's dtype
    counts: jax.Array | None = None  # ``key.kept``: the members' Pick.counts stacked


def _route(plan: Plan, b) -> str:
    return plan.groups[b.group][0].route


def _norms_by_batch(plan: Plan, sq_sums, route: str) -> dict[int, jax.Array]:
    """Per batch on ``route`` whose sums of squares are known (``sq_sums``: per batch; keyed by
    index in ``plan.batches``), its members' :func:`_norms.norm_from_sq_sum`, ``(batch,)``."""
    return {j: _norms.norm_from_sq_sum(s) for j, (b, s) in enumerate(zip(plan.batches, sq_sums))
            if s is not None and _route(plan, b) == route}


def _per_unit(plan: Plan, by_batch: dict[int, jax.Array], uids) -> dict[int, jax.Array]:
    """Per unit of ``uids``, its slice of its batch's array in ``by_batch`` (where there is
    one): the slices only units that need their own are given."""
    out: dict[int, jax.Array] = {}
    wanted = set(uids)
    for j, x in by_batch.items():
        b = plan.batches[j]
        if wanted.intersection(b.uids):
            out.update(zip(b.uids, _megabatch.unstack(x, _sizes(plan, b.uids), True)))
    return out


def _per_group(plan: Plan, group: int, by_batch) -> jax.Array:
    """The group's batches' arrays (``by_batch``: per batch index) stacked: the group's members
    are its batches' members, consecutive and in order."""
    return _megabatch.stack([by_batch[j] for j, b in enumerate(plan.batches)
                             if b.group == group])


def _sent_norms(plan: Plan, sq_sums, picks) -> dict[int, jax.Array]:
    """‖S‖_F of every all-to-all payload's whole matrix: the devices' partial sums of squares
    all-reduced (one float per matrix; one collective per mesh-axes tuple). Global-scope row
    segments all-gather their picked rows' sums instead (``pick`` floats per matrix, each
    added in a fixed order: the bits of the same row on one device) and add the ``k``
    selected ones in the order of their values, as one device under global scope does, so
    that the polar's input is the one-device input bitwise."""
    sel = [j for j, b in enumerate(plan.batches) if _route(plan, b) == "all_to_all"]
    rows = [j for j in sel if sq_sums[j].ndim == 2]
    sel = [j for j in sel if sq_sums[j].ndim == 1]
    unit = lambda j: plan.units[plan.batches[j].uids[0]]  # noqa: E731
    whole: list[jax.Array | None] = [None] * len(plan.batches)
    for j, t in zip(sel, batched_psum([(sq_sums[j], unit(j).matrix_axes) for j in sel])):
        whole[j] = t
    # Column tiles: each picked row's sum over its column pieces first.
    row_sums = batched_psum([(sq_sums[j], unit(j).col_comm) for j in rows])
    for j, g in zip(rows, batched_all_gather([(r, unit(j).comm)
                                              for j, r in zip(rows, row_sums)])):
        b = plan.batches[j]
        counts = _megabatch.stack([picks[i].counts for i in b.uids])
        g = jnp.moveaxis(g, 0, 1).reshape((g.shape[1], -1))          # (batch, W · pick)
        kept = _megabatch.kept_rows(g, counts, plan.units[b.uids[0]].k)
        whole[j] = _norms.total_in_value_order(kept, 1)          # the one-device bits
    return _norms_by_batch(plan, whole, "all_to_all")


def _pad_to(orth, u: Unit, total: int, shape: tuple[int, int]) -> int | None:
    """The picked axis' length the orthogonalizer iterates on for ``total`` payloads of
    ``shape`` when it pads that axis alone (the stack is then written so padded: no pad pass
    before the iteration); else None."""
    padded, picked = orth.padded_shape((total, *shape)), u.layout.row_axis - 1
    if padded[1 - picked] != shape[1 - picked] or padded[picked] == shape[picked]:
        return None
    return padded[picked]


def _one_pass_payloads(plan: Plan, acc: Accumulated, group: int, norms: dict, rows
                       ) -> jax.Array:
    """A group of one-pass units: its stacked normalized payloads, from one read of the units'
    ``S`` (:func:`pallas_kernels.stack_payloads`, with the batches' selected rows ``rows``
    unless they are full; ``norms``: per batch, ``‖S[I]‖_F``). An on-device group's stack is
    padded as the iteration pads it (:func:`_pad_to`; :func:`megabatched_polar` drops the
    padding from the factors)."""
    key, uids = plan.groups[group]
    orth, u = plan.orthogonalizer, plan.units[uids[0]]
    pad_to = (_pad_to(orth, u, sum(_sizes(plan, uids)), key.shape)
              if key.route == "on_device" and not u.full else None)
    return pallas_kernels.stack_payloads(
        [acc.momentum[plan.units[i].leaf][plan.units[i].block] for i in uids],
        _per_group(plan, group, norms) + _some(orth.eps), out_dtype=orth.input_dtype,
        rows=None if u.full else _per_group(plan, group, dict(enumerate(rows))),
        row_axis=u.layout.row_axis,
        padded=any(plan.units[i].shard == "rows" for i in uids), pad_to=pad_to,
        implementation=PAYLOAD_IMPLEMENTATION[plan.pass_implementation][0 if u.full else 1])


def gather_and_send(plan: Plan, acc: Accumulated, picks: tuple[Pick, ...], rows, sq_sums
                    ) -> list[GroupBatch]:
    """Groups the payloads by shape. Groups of one-pass units get their normalized,
    cast payloads stacked from one read of their ``S`` (``rows``: per batch, the selected
    rows). Other on-device groups stay a list of parts (normalized per part by the
    orthogonalizer). All-to-all groups are normalized by their whole matrices' norms and cast
    to the orthogonalizer's input dtype before they are stacked for the collective
    (``plan.send_normalized``); otherwise (a user's callable, compressed sync: then averaged
    over the replicas first) the raw payloads are stacked."""
    orth = plan.orthogonalizer
    sent = _sent_norms(plan, sq_sums, picks) if plan.send_normalized else {}
    local = _norms_by_batch(plan, sq_sums, "on_device")
    # Per-unit norms only where a group's parts are normalized one by one.
    by_part = [i for key, uids in plan.groups if uids[0] not in acc.one_pass for i in uids]
    local_units, sent_units = _per_unit(plan, local, by_part), _per_unit(plan, sent, by_part)
    batches = []
    for g, (key, uids) in enumerate(plan.groups):
        one_pass = uids[0] in acc.one_pass
        parts = None if one_pass else [_orient(_some(picks[i].payload), plan.units[i].swap)
                                       for i in uids]
        on_device = key.route == "on_device"
        norms = [local_units.get(i) for i in uids]
        stacked = None
        normalized = ((key.route == "all_to_all" and plan.send_normalized)
                      or (on_device and one_pass))
        if one_pass:
            stacked = _one_pass_payloads(plan, acc, g, local if on_device else sent, rows)
        elif normalized:
            stacked = _megabatch.stack([
                (p.astype(jnp.float32) / (sent_units[i] + _some(orth.eps))[:, None, None]
                 ).astype(orth.input_dtype) for i, p in zip(uids, _some(parts))])
        elif not (on_device and plan.stack_on_device):
            stacked = _megabatch.stack(_some(parts))
            if plan.ctx.compressed:
                stacked = replica_mean(stacked, _some(plan.ctx.replica_axis),
                                       plan.replica_wire_dtype)
        counts = (_megabatch.stack([_some(picks[i].counts) for i in uids]) if key.kept
                  else None)
        batches.append(GroupBatch(key, uids, parts, norms, stacked, normalized, counts))
    return batches


def _batch_factors(plan: Plan, group: int, o: jax.Array) -> dict:
    """Per batch of group ``group`` (by index in ``plan.batches``), its :class:`BatchFactors`:
    the group's members are its batches' members, consecutive and in order."""
    out, start = {}, 0
    for j, b in enumerate(plan.batches):
        if b.group != group:
            continue
        u, size = plan.units[b.uids[0]], sum(_sizes(plan, b.uids))
        ra = 3 - u.layout.row_axis if u.swap else u.layout.row_axis
        out[j] = BatchFactors(jax.lax.slice_in_dim(o, start, start + size), ra)
        start += size
    return out


def megabatched_polar(plan: Plan, batches: list[GroupBatch]
                      ) -> tuple[tuple[Polar, ...], tuple[BatchFactors, ...]]:
    """One orthogonalizer call per shape group (with its all-to-all or all-gather around it).

    Returns:
      Per unit its :class:`Polar`; per batch its :class:`BatchFactors`.
    """
    orth = plan.orthogonalizer
    out: list[Polar | None] = [None] * len(plan.units)
    per_batch: dict[int, BatchFactors] = {}
    for g, b in enumerate(batches):
        sizes = _sizes(plan, b.uids)
        selected: list[jax.Array | None]
        if b.stacked is None:
            parts = _some(b.parts)
            o = _megabatch.checked(lambda ps: orth.stacked(ps, b.norms), parts)
            selected = list(parts)
        elif b.normalized:          # normalized and cast already: the iteration only
            o = _megabatch.orthogonalize_group(b.stacked, b.key, plan.ctx.size(b.key.axes),
                                               orth.of_normalized, b.counts)
            selected = list(b.parts) if b.parts else [None] * len(b.uids)
        else:
            o = _megabatch.orthogonalize_group(b.stacked, b.key, plan.ctx.size(b.key.axes), orth,
                                               b.counts)
            selected = list(_megabatch.unstack(b.stacked, sizes))
        pieces = _megabatch.unstack(o, sizes, True)
        if o.shape[1:] != b.key.shape:  # a padded stack (_pad_to): sliced after the barrier,
            rows, cols = b.key.shape    # so that no unpadded copy is written
            pieces, o = [f[:, :rows, :cols] for f in pieces], o[:, :rows, :cols]
        for i, s, f in zip(b.uids, selected, pieces):
            swap = plan.units[i].swap
            out[i] = Polar(None if s is None else _orient(s, swap), _orient(f, swap))
        per_batch.update(_batch_factors(plan, g, o))
    return tuple(out), tuple(per_batch[j] for j in range(len(plan.batches)))  # type: ignore


def row_sources(plan: Plan, acc: Accumulated, rows: tuple) -> tuple:
    """Per batch that selects, :func:`_selection.row_sources` of its members' rows stacked,
    ``(source, keep)`` per row of their blocks (one scatter per batch, on the batch's stacked
    rows ``rows`` from :func:`select`); None where every row goes."""
    out = []
    for b, r in zip(plan.batches, rows):
        u = plan.units[b.uids[0]]
        n_local = acc.momentum[u.leaf][u.block].shape[u.layout.row_axis]
        out.append(None if r is None else _selection.row_sources(
            _selection.row_positions(r, n_local), r.shape[1]))
    return tuple(out)


def _unit_sources(plan: Plan, batch_src: tuple) -> tuple:
    """:func:`row_sources` per unit (its members' slices of the batch's arrays)."""
    out: list[tuple | None] = [None] * len(plan.units)
    for b, src in zip(plan.batches, batch_src):
        if src is not None:
            sizes = _sizes(plan, b.uids)
            for i, s, k in zip(b.uids, *(_megabatch.unstack(x, sizes, True) for x in src)):
                out[i] = (s, k)
    return tuple(out)


def error_feedback(plan: Plan, mu, acc: Accumulated, polars, row_src, batch_src, count=0
                   ) -> tuple[Blocks, Blocks]:
    """``M[I] ← μ·S`` on every unit (``row_src``: :func:`row_sources` per unit, ``batch_src``
    per batch); returns the momentum blocks and their per-row factors ``d`` (the momentum is
    ``d ⊙ M``).

    One-pass units (:func:`_accumulate`) keep ``S`` as written and defer the decay: ``d`` is
    ``μ`` on their selected rows (:func:`_rules.deferred_decay`, once per batch), so the next
    step's ``d ⊙ M + G`` applies it on its way through. The other units decay their rows here
    (``d = 1``). Without compressed sync ``S`` is the block's own rows, which decay in place (no
    gather of ``S``); under it ``S`` is the replicas' mean. A 16-bit ``μ·S`` is rounded
    stochastically (bits of the step ``count``, :func:`_momentum_bits`)."""
    mu = jnp.asarray(mu, jnp.float32)
    momentum = [list(b) for b in acc.momentum]
    decays = {u.leaf for u in plan.units if u.uid not in acc.one_pass}   # (no bits for others)
    dtypes = [b[0].dtype if i in decays else jnp.float32 for i, b in enumerate(acc.momentum)]
    keys = _write_keys(plan, dtypes, count, _rounding.DECAY)
    bits = [None if r is None else p.local.to_blocks(r)
            for p, r in zip(plan.leaves, _momentum_bits(plan, dtypes, keys))]
    scales: list[list[jax.Array | None]] = [[None] * len(b) for b in acc.momentum]
    for b, src in zip(plan.batches, batch_src):
        u = plan.units[b.uids[0]]
        if u.uid in acc.one_pass and src is not None:
            ra, sizes = u.layout.row_axis, _sizes(plan, b.uids)
            d = _rules.deferred_decay(mu, src[1], (sum(sizes), _local_shape(plan, u)[ra]))
            for i, piece in zip(b.uids, _megabatch.unstack(d, sizes)):
                scales[plan.units[i].leaf][plan.units[i].block] = jnp.expand_dims(piece, 3 - ra)
    for u in plan.units:
        ra = u.layout.row_axis
        if u.uid not in acc.one_pass:
            s = polars[u.uid].selected if plan.ctx.compressed else None
            momentum[u.leaf][u.block] = _rules.error_feedback(
                momentum[u.leaf][u.block], s, mu, row_src[u.uid], ra,
                None if (leaf_bits := bits[u.leaf]) is None else leaf_bits[u.block])
        if scales[u.leaf][u.block] is None:   # every row decays now (1) or deferred (μ)
            shape = list(_local_shape(plan, u))
            shape[3 - ra] = 1
            scales[u.leaf][u.block] = _rules.deferred_decay(
                1.0 if u.uid not in acc.one_pass else mu, None, tuple(shape))
    return momentum, _filled(scales)


class Moments(NamedTuple):
    """One batch's NorMuon statistics, its members stacked along the batch axis."""

    row_sq: jax.Array       # (batch, pick) ‖O_i‖² (summed over column shards), float32
    v_new: jax.Array        # (batch, pick) the selected rows' new second moments, float32
    a: jax.Array            # (batch, pick) the row divisors √v_new + ε


def _stacked_variance(plan: Plan, b, variance: Blocks) -> jax.Array:
    """The batch's members' second-moment blocks, ``(batch, n_local)``, in their dtype."""
    ra = plan.units[b.uids[0]].layout.row_axis
    return _megabatch.stack([jnp.squeeze(variance[plan.units[i].leaf][plan.units[i].block],
                                         3 - ra) for i in b.uids])


def _batch_moments(plan: Plan, beta2, b, variance: Blocks, rows, sq: jax.Array) -> Moments:
    """A batch's :class:`Moments` (``rows``: the batch's stacked local rows, None when every
    row is selected; ``sq``: its factors' :func:`_row_sq`): the variance gather and NorMuon's
    elementwise EMA once per batch."""
    v = _stacked_variance(plan, b, variance)
    v_sel = v if rows is None else _selection.take_rows(v, jnp.minimum(rows, v.shape[1] - 1))
    v_new, a = _rules.normuon_ema(v_sel.astype(jnp.float32), sq,
                                  plan.units[b.uids[0]].layout.c,
                                  jnp.asarray(beta2, jnp.float32))
    return Moments(sq, v_new, a)


def _fro_terms(m: Moments) -> jax.Array:
    """``(2, batch)``: :func:`_rules.normuon_fro` of each member of the batch, from its stacked
    :class:`Moments`."""
    return jnp.stack(_rules.normuon_fro(m.row_sq, m.a))


def _new_variance(m: Moments, src, base: jax.Array) -> jax.Array:
    """``base`` (the batch's second moments as written so far, ``(batch, n_local)``) with
    ``v_new`` in the selected rows (``src``: the batch's :func:`row_sources`, None when every
    row is selected). The row segments of one leaf are in different batches, and each writes
    only its own rows into what the ones before it wrote."""
    if src is None:
        return m.v_new.astype(base.dtype)
    return _selection.place_rows(m.v_new[:, :, None], src, 1, base=base[:, :, None])[:, :, 0]


def _row_sq(plan: Plan, factors: tuple[BatchFactors, ...]) -> list[jax.Array]:
    """Per batch, ``(batch, rows)``: ``‖O_i‖²`` of its factors' rows
    (:func:`_rules.row_sq_norms`, summed over column shards), one reduction per batch over the
    batch's factors as the polar wrote them."""
    return batched_psum([
        (_rules.row_sq_norms(f.factors, f.row_axis), plan.units[b.uids[0]].col_axes)
        for b, f in zip(plan.batches, factors)])


def normalize(plan: Plan, beta2, acc: Accumulated, rows, polars, factors, batch_src
              ) -> tuple[tuple[jax.Array, ...], Blocks | None]:
    """NorMuon (per whole matrix: partial sums all-reduced over the shards) or Muon directions;
    returns the float32 directions and the new second-moment blocks. The factors' row sums run
    once per batch (``factors``: :class:`BatchFactors`), the directions per unit (each leaf's
    kernel reads its factors directly); the elementwise statistics, the variance gather and its
    write-back once per batch (``batch_src``: :func:`row_sources`)."""
    if not plan.normuon:
        return tuple(_rules.muon_directions(p.factors) for p in polars), None
    units, variance_in = plan.units, _some(acc.variance)
    moments = [_batch_moments(plan, beta2, b, variance_in, r, sq)
               for b, r, sq in zip(plan.batches, rows, _row_sq(plan, factors))]
    fros = batched_psum([(_fro_terms(m),
                          units[b.uids[0]].comm if units[b.uids[0]].shard == "rows" else ())
                         for b, m in zip(plan.batches, moments)])
    variance = [list(b) for b in variance_in]
    dirs: list[jax.Array | None] = [None] * len(units)
    for b, m, fro, src in zip(plan.batches, moments, fros, batch_src):
        ra, sizes = units[b.uids[0]].layout.row_axis, _sizes(plan, b.uids)
        scales = _megabatch.unstack(_rules.normuon_row_scales(m.a, fro), sizes, True)
        # The new variances' pieces share their operand (no barrier): only the state's small
        # outputs read them, and XLA writes a batch's pieces in one multi-output kernel.
        new = _megabatch.unstack(_new_variance(m, src, _stacked_variance(plan, b, variance)),
                                 sizes)
        for i, s, v in zip(b.uids, scales, new):
            dirs[i] = _rules.scale_rows(polars[i].factors, s, ra)
            variance[units[i].leaf][units[i].block] = jnp.expand_dims(v, 3 - ra)
    return tuple(_some(d) for d in dirs), variance


def scatter_and_apply(plan: Plan, grads, dirs, row_src) -> list[jax.Array]:
    """The scaled directions written into zero updates (selected rows only); blocks → leaves,
    in :func:`_rules.update_dtype` of each gradient (float32 for 16-bit leaves)."""
    ublk: list[list[jax.Array | None]] = [[None] * len(p.local.blocks) for p in plan.leaves]
    for u in plan.units:
        d = u.lr_scale * dirs[u.uid]
        ublk[u.leaf][u.block] = d if u.full else _selection.place_rows(
            d, row_src[u.uid], u.layout.row_axis, base=ublk[u.leaf][u.block])
    return _leaves(plan, _filled(ublk),
                   [jax.ShapeDtypeStruct(jnp.shape(g), _rules.update_dtype(g.dtype))
                    for g in grads])


def _leaves(plan: Plan, blocks: Blocks | None, like) -> list[jax.Array]:
    """Blocks → leaves shaped and typed like ``like`` (none for None)."""
    if blocks is None:
        return []
    return [p.local.from_blocks(b, x.shape).astype(x.dtype)
            for p, x, b in zip(plan.leaves, like, blocks)]


class Coefficients(NamedTuple):
    """The step's scalar hyperparameters: numbers, or arrays that may be traced
    (``optax.inject_hyperparams``), so they travel beside the arrays, not in the static plan."""

    mu: Any      # the selected rows' error-feedback decay (:func:`error_feedback`)
    beta2: Any   # NorMuon's second-moment EMA coefficient (:func:`normalize`)


def _all_axes(plan: Plan) -> tuple[str, ...]:
    """The mesh axes whose devices' momenta meet in the step (its own and a manual replica
    axis)."""
    ctx = plan.ctx
    axes = tuple(ctx.axis_names) if ctx.distributed else ()
    if ctx.compressed and ctx.replica_axis is not None and ctx.replica_axis not in axes:
        axes += (ctx.replica_axis,)
    return nontrivial(axes)


def _pmax(plan: Plan, x: jax.Array) -> jax.Array:
    axes = _all_axes(plan)
    return jax.lax.pmax(x, axes) if axes else x


def _write_scales(plan: Plan, grads, moms, bounds, count) -> list[jax.Array | None]:
    """Per leaf, the write scale of a float16 momentum (:mod:`dion3_jax._storage`) from its
    ``bounds`` entry, or at the first step from its gradient's largest entry (one ``pmax`` for
    all leaves); None for other dtypes."""
    idx = [i for i, m in enumerate(moms) if _storage.scaled(m.dtype)]
    out: list[jax.Array | None] = [None] * len(moms)
    if not idx:
        return out

    def first():
        return _pmax(plan, jnp.stack([jnp.max(jnp.abs(grads[i])).astype(jnp.float32)
                                      for i in idx]))

    kept = jnp.stack([jnp.asarray(bounds[i], jnp.float32) for i in idx])
    scale = _storage.write_scale(jax.lax.cond(count == 0, first, lambda: kept))
    for j, i in enumerate(idx):
        out[i] = scale[j]
    return out


def _bound_terms(plan: Plan, acc: Accumulated, u: Unit) -> jax.Array:
    """Sums of ``(S·2⁻³²)²`` over parts of unit ``u``'s block that together hold every entry
    (flattened, in the units ``S`` was written in): its rows', else (a full unit whose payload
    norm the step took from the whole matrix) its matrices', else (a unit with neither) new
    row sums."""
    sq = acc.row_sq.get((u.leaf, u.block))
    if sq is None:
        sq = acc.full_sq.get(u.uid)
    if sq is None:
        sq = _selection.row_sq_sums(acc.momentum[u.leaf][u.block], u.layout.row_axis)
    return jnp.ravel(sq)


def _new_bounds(plan: Plan, acc: Accumulated, out_scales, bounds) -> list[jax.Array]:
    """Per leaf, the bound the next write of a float16 momentum is scaled by: the largest row
    norm of ``S`` in the gradients' units (the largest of its :func:`_bound_terms`, as a norm,
    over its write scale ``c``), over every device: one reduction and one ``pmax`` for all
    leaves; ``bounds``' entry for other leaves. Each leaf's bound is its own elementwise
    result, which XLA writes with the others in a few passes (slices of one table of bounds,
    which the state keeps leaf by leaf, took a pass each from about 32 leaves on)."""
    leaves, terms, ids = [], [], []
    for u in plan.units:
        if out_scales[u.leaf] is None:
            continue
        if u.leaf not in leaves:
            leaves.append(u.leaf)
        t = _bound_terms(plan, acc, u)
        terms.append(t)
        ids.append(np.full(t.shape, leaves.index(u.leaf), np.int32))
    if not leaves:
        return list(bounds)
    sq = _pmax(plan, jax.ops.segment_max(jnp.concatenate(terms), np.concatenate(ids),
                                         num_segments=len(leaves)))
    out = list(bounds)
    for j, i in enumerate(leaves):
        out[i] = jnp.sqrt(sq[j]) * np.float32(2.0 ** 32) / out_scales[i]
    return out


def step(plan: Plan, coefficients: Coefficients, grads, moms, vars_, scales, count,
         bounds=None):
    """The per-device Dion3 step: lists of leaves in (``scales``: the momenta's per-row factors
    ``d``; ``bounds``: per leaf, the float16 momenta's :mod:`dion3_jax._storage` bounds),
    ``(updates, momenta, variances, scales, bounds)`` out."""
    bounds = [jnp.zeros((), jnp.float32)] * len(moms) if bounds is None else bounds
    out_scales = _write_scales(plan, grads, moms, bounds, count)
    acc = accumulate_and_score(plan, grads, moms, vars_, scales, count, out_scales)
    picks, rows, sq_sums = select(plan, acc)
    batches = gather_and_send(plan, acc, picks, rows, sq_sums)
    polars, factors = megabatched_polar(plan, batches)
    batch_src = row_sources(plan, acc, rows)
    row_src = _unit_sources(plan, batch_src)
    momentum, new_scales = error_feedback(plan, coefficients.mu, acc, polars, row_src, batch_src,
                                          count)
    dirs, variance = normalize(plan, coefficients.beta2, acc, rows, polars, factors, batch_src)
    new_d = [d if c is None else d / c
             for d, c in zip(_leaves(plan, new_scales, scales), out_scales)]
    return (scatter_and_apply(plan, grads, dirs, row_src), _leaves(plan, momentum, moms),
            _leaves(plan, variance, vars_), new_d, _new_bounds(plan, acc, out_scales, bounds))
