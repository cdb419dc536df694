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

from dion3_jax import _layout, _megabatch, _selection
from dion3_jax._polar import make_orthogonalizer

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


def normuon_normalize(o: jax.Array, v_sel: jax.Array, beta2, row_axis: int
                      ) -> tuple[jax.Array, jax.Array]:
    """NorMuon row normalisation of a block of orthogonalized rows, in float32.

    Args:
      o: orthogonalized selected rows, ``(batch, k, C)`` or ``(batch, C, k)``.
      v_sel: their second moments, ``(batch, k, 1)`` or ``(batch, 1, k)``.
      beta2: EMA coefficient.
      row_axis: 1 or 2.

    Returns:
      ``(D, v_new)``: the normalised rows (float32, Frobenius norm of ``o`` per matrix) and the
      updated second moments (float32).
    """
    col_axis = 3 - row_axis
    o = o.astype(jnp.float32)
    norm_o = jnp.sqrt(jnp.sum(jnp.square(o), axis=(1, 2), keepdims=True))
    nu = jnp.mean(jnp.square(o), axis=col_axis, keepdims=True)
    beta2 = jnp.asarray(beta2, jnp.float32)
    v_new = beta2 * v_sel.astype(jnp.float32) + (1.0 - beta2) * nu
    d = o / (jnp.sqrt(v_new) + NORMUON_EPS)
    norm_d = jnp.sqrt(jnp.sum(jnp.square(d), axis=(1, 2), keepdims=True))
    d = d * (norm_o / jnp.maximum(norm_d, NORMUON_EPS))
    return d, v_new


class _Block(NamedTuple):
    layout: _layout.BlockLayout
    m: jax.Array            # M + G, before decay
    m_new: jax.Array        # after error-feedback decay
    idx: jax.Array | None   # (batch, k) selected rows; None when every row is selected
    s: jax.Array            # selected rows (pre-decay)
    v: jax.Array | None     # second-moment block (batch, 1, n) / (batch, n, 1)


def _select(layout: _layout.BlockLayout, m: jax.Array, fraction: float, mu,
            v: jax.Array | None) -> _Block:
    k = _selection.num_selected(fraction, layout.n)
    mu = jnp.asarray(mu, jnp.float32)
    if k == layout.n:  # every row: no selection, no gather / scatter
        return _Block(layout, m, (mu * m).astype(m.dtype), None, m, v)
    scores = _selection.row_l1_norms(m, layout.row_axis)
    idx = _selection.top_rows(scores, k)
    s = _selection.gather_rows(m, idx, layout.row_axis)
    m_new = _selection.scatter_rows(m, idx, (mu * s).astype(m.dtype), layout.row_axis)
    return _Block(layout, m, m_new, idx, s, v)


def _finish(block: _Block, o: jax.Array, flavour: str, beta2, scale: float
            ) -> tuple[jax.Array, jax.Array | None]:
    """Normalises ``o`` and scatters it into a zero update; returns (update, new variance)."""
    ra = block.layout.row_axis
    v_new = block.v
    if flavour == "normuon":
        v_sel = block.v if block.idx is None else _selection.gather_rows(block.v, block.idx, ra)
        d, v_sel_new = normuon_normalize(o, v_sel, beta2, ra)
        if block.idx is None:
            v_new = v_sel_new.astype(block.v.dtype)
        else:
            v_new = _selection.scatter_rows(block.v, block.idx, v_sel_new, ra)
    else:
        d = o.astype(jnp.float32)
    d = scale * d
    if block.idx is None:
        return d, v_new
    zeros = jnp.zeros(block.layout.shape, jnp.float32)
    return _selection.scatter_rows(zeros, block.idx, d, ra), v_new


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

    Returns:
      An ``optax.GradientTransformation`` with state :class:`ScaleByDion3State`.

    Raises:
      ValueError: for an invalid hyperparameter (at construction) or a leaf that is not a
        matrix (at init).

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
    mu_dtype = optax._src.utils.canonicalize_dtype(mu_dtype)
    if orthogonalizer is None:
        orthogonalizer = make_orthogonalizer(
            method=method, coefficients=coefficients, restarts=tuple(restarts),
            compute_dtype=compute_dtype, backend=backend)
    elif not callable(orthogonalizer):
        raise ValueError(f"orthogonalizer must be callable, got {orthogonalizer=!r}")
    if not callable(num_heads) and _layout.is_single_value(num_heads):
        _layout.check_num_heads(num_heads)
    if not callable(split_sizes) and _layout.is_single_value(split_sizes):
        _layout.check_split_sizes(split_sizes)
        if split_sizes is not None and isinstance(num_heads, int) and num_heads > 1:
            raise ValueError(f"num_heads and split_sizes cannot be combined, got {num_heads=} "
                             f"and {split_sizes=}")

    def layouts(tree) -> tuple[list, list, Any]:
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
        dn = _layout.per_leaf(dimension_numbers, tree)
        nh = _layout.per_leaf(num_heads, tree)
        ss = _layout.per_leaf(split_sizes, tree)
        out = []
        for path, leaf in flat:
            out.append(_layout.make_layout(
                tuple(leaf.shape), dn(path), nh(path), ss(path), name=_layout.path_str(path)))
        return [leaf for _, leaf in flat], out, treedef

    def init_fn(params):
        leaves, lays, treedef = layouts(params)
        mom = [jnp.zeros(p.shape, mu_dtype or p.dtype) for p in leaves]
        var = None
        if flavour == "normuon":
            var = treedef.unflatten([jnp.zeros(l.variance_shape, jnp.float32) for l in lays])
        return ScaleByDion3State(
            count=jnp.zeros([], jnp.int32), momentum=treedef.unflatten(mom), variance=var)

    def update_fn(updates, state, params=None):
        del params
        grads, lays, treedef = layouts(updates)
        moms = treedef.flatten_up_to(state.momentum)
        vars_ = (treedef.flatten_up_to(state.variance) if flavour == "normuon"
                 else [None] * len(grads))

        blocks, owners = [], []
        for i, (g, m, v, lay) in enumerate(zip(grads, moms, vars_, lays)):
            m_blocks = lay.to_blocks(m + g.astype(m.dtype))
            v_blocks = lay.to_blocks(v) if v is not None else [None] * len(m_blocks)
            for bl, mb, vb in zip(lay.blocks, m_blocks, v_blocks):
                blocks.append(_select(bl, mb, fraction, mu, vb))
                owners.append(i)

        ortho = _megabatch.orthogonalize_blocks([b.s for b in blocks], orthogonalizer)

        per_leaf_u = [[] for _ in grads]
        per_leaf_m = [[] for _ in grads]
        per_leaf_v = [[] for _ in grads]
        for owner, block, o in zip(owners, blocks, ortho):
            scale = lr_scale(adjust_lr, block.layout.n, block.layout.c)
            u, v_new = _finish(block, o, flavour, beta2, scale)
            per_leaf_u[owner].append(u)
            per_leaf_m[owner].append(block.m_new)
            per_leaf_v[owner].append(v_new)

        new_updates, new_moms, new_vars = [], [], []
        for i, (g, m, v, lay) in enumerate(zip(grads, moms, vars_, lays)):
            new_updates.append(lay.from_blocks(per_leaf_u[i], g.shape).astype(g.dtype))
            new_moms.append(lay.from_blocks(per_leaf_m[i], m.shape).astype(m.dtype))
            if v is not None:
                new_vars.append(lay.from_blocks(per_leaf_v[i], v.shape).astype(v.dtype))
        variance = treedef.unflatten(new_vars) if flavour == "normuon" else None
        new_state = ScaleByDion3State(
            count=optax.safe_increment(state.count), momentum=treedef.unflatten(new_moms),
            variance=variance)
        return treedef.unflatten(new_updates), new_state

    return optax.GradientTransformation(init_fn, update_fn)
