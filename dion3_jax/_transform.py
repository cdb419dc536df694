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
"""``scale_by_dion3``: the optax shell (state, init, update) around the Dion3 step.

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
``W ← W − lr·(wd·W + update)``. The static plan is in ``_plan``, the traced phases in ``_step``,
the per-matrix maths in ``_rules`` (``docs/ARCHITECTURE.md`` maps the whole flow).

References:
  Amsel, Zhang, Ahn, Naeimi, Feng, Chen, Dao, Langford, `Dion3: Full-Stack Orthogonal Updates
  <https://arxiv.org/abs/2608.11612>`_, 2026.
  Ahn et al., `Dion: Distributed Orthonormalized Updates <https://arxiv.org/abs/2504.05295>`_,
  2025.
  Li et al., `NorMuon: Making Muon more efficient and scalable
  <https://arxiv.org/abs/2510.05491>`_, 2025.
"""

from collections.abc import Callable
from fractions import Fraction
from typing import Any, NamedTuple, Self

import jax
import jax.numpy as jnp
import optax

from dion3_jax import _distributed, _param_metadata, _plan, _step, _storage
from dion3_jax._config import AdjustLR, Dion3Config, Flavor, PassImplementation, make_config
from dion3_jax._distributed import MeshOptions
from dion3_jax._layout import DimensionNumbers
from dion3_jax._orthogonalizer import Orthogonalizer
from dion3_jax._types import OptState, PerLeaf

#: ``jax.tree_util.PyTreeDef`` as type checkers should see it: jaxlib 0.11 ships no stub of the
#: compiled module that defines the class, so they would know none of its methods.
_TreeDef = Any


class ScaleByDion3State(NamedTuple):
    """State of :func:`scale_by_dion3`.

    The momentum is stored as two factors: the momentum of a leaf is ``momentum *
    momentum_scale`` (broadcast along the reduction axes; :meth:`full_momentum` computes it).
    The step writes ``S = M + G`` once and leaves its selected rows' decay ``μ`` in
    ``momentum_scale``, where the next step applies it as it reads the momentum: one full pass
    over the momentum fewer per step.

    Attributes:
      count: the number of updates applied; shape ``()``, int32.
      momentum: shaped like the params; dtype ``mu_dtype`` (default: float16 for 16-bit
        parameters, else the parameter's).
      variance: the NorMuon per-row second moments, float32, each param's shape with its
        reduction axes of size 1; None for ``flavor="muon"``.
      momentum_scale: the momentum's per-row factors (1 or ``μ``; a float16 momentum's also
        carry its storage scale), float32, shaped like the second moments.
      momentum_bound: for a float16 momentum, per leaf, the largest row norm of the momentum
        the last step wrote, a float32 scalar that sets the next write's storage scale
        (:mod:`dion3_jax._storage`; 0 for the leaves of other dtypes); None when no leaf's
        momentum is float16.
    """

    # optax's name for the step count (its states' too), which shadows tuple.count.
    count: jax.Array  # type: ignore[assignment]
    momentum: optax.Updates
    variance: optax.Updates | None
    momentum_scale: optax.Updates
    momentum_bound: optax.Updates | None = None

    def full_momentum(self) -> optax.Updates:
        """The momentum, ``momentum * momentum_scale``, in the momentum's dtype; a float16
        momentum's in float32 (stored with a scale, it may lie outside float16's range)."""
        def full(m, d):
            if _storage.scaled(m.dtype):
                return m.astype(jnp.float32) * d
            return (m * d).astype(m.dtype)
        return jax.tree.map(full, self.momentum, self.momentum_scale)

    def folded(self) -> Self:
        """This state with ``momentum`` = :meth:`full_momentum` and ``momentum_scale`` ones;
        a float16 momentum keeps a power of two per leaf in ``momentum_scale``
        (:func:`dion3_jax._storage.fold_unit`), its storage scale, so that its entries stay
        within float16's range."""
        units = jax.tree.map(lambda m, d: _storage.fold_unit(d) if _storage.scaled(m.dtype)
                             else jnp.ones((), jnp.float32), self.momentum, self.momentum_scale)
        # (``ones_like`` keeps the factors' sharding; a unit of 1 leaves both as before)
        return self._replace(
            momentum=jax.tree.map(lambda m, d, u: (m * (d / u)).astype(m.dtype),
                                  self.momentum, self.momentum_scale, units),
            momentum_scale=jax.tree.map(lambda m, d, u: jnp.ones_like(d) * u,
                                        self.momentum, self.momentum_scale, units))


def fold_momentum_scale(opt_state: OptState) -> OptState:
    """Every :class:`ScaleByDion3State` in ``opt_state`` with its row factors folded into the
    momentum: ``momentum`` becomes :meth:`ScaleByDion3State.full_momentum` and
    ``momentum_scale`` ones. The optimizer continues from it as from the state it came from (up
    to one rounding of the momentum); two states that hold the same momentum in different
    factors (say, from a sharded and a single-device run) compare equal once folded.

    Args:
      opt_state: any optimizer state (a tree) containing :class:`ScaleByDion3State` nodes.

    Returns:
      The state with every Dion3 node folded (the same structure, shapes and dtypes).

    Examples:
      >>> import jax.numpy as jnp, dion3_jax
      >>> tx = dion3_jax.scale_by_dion3(0.5, mu=0.5)
      >>> _, state = tx.update({"w": jnp.ones((2, 4))}, tx.init({"w": jnp.zeros((2, 4))}))
      >>> folded = dion3_jax.fold_momentum_scale(state)
      >>> float(folded.momentum["w"].sum()), float(folded.momentum_scale["w"].min())
      (6.0, 1.0)
    """
    return jax.tree.map(lambda x: x.folded() if isinstance(x, ScaleByDion3State) else x,
                        opt_state, is_leaf=lambda x: isinstance(x, ScaleByDion3State))


def any_committed(params) -> bool:
    """Whether any concrete leaf of ``params`` is committed to its devices.

    jit commits its outputs when any input is committed. The state ``init`` returns follows the
    same rule, so a step fed its own outputs sees the placements of its first call and compiles
    once, whether the params were made with ``jnp`` (uncommitted) or placed with
    ``jax.device_put`` (committed).
    """
    return any(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.committed
               for x in jax.tree.leaves(params))


def _zeros(shape, dtype, ref, spec, ctx: _distributed.Context, commit: bool) -> jax.Array:
    """Zeros placed like ``ref``'s mesh with ``spec`` (state leaves keep the params' layout);
    on one device, committed to ``ref``'s device only if ``commit`` (:func:`any_committed`)."""
    concrete = isinstance(ref, jax.Array) and not isinstance(ref, jax.core.Tracer)
    if not ctx.distributed:
        if commit and concrete and len(ref.sharding.device_set) == 1:
            return jnp.zeros(shape, dtype, device=ref.sharding)
        return jnp.zeros(shape, dtype)
    sharding = getattr(ref, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding) and concrete:
        return jnp.zeros(shape, dtype, device=jax.sharding.NamedSharding(sharding.mesh, spec))
    if ctx.concrete_mesh is not None and concrete:
        return jnp.zeros(shape, dtype,
                         device=jax.sharding.NamedSharding(ctx.concrete_mesh, spec))
    z = jnp.zeros(shape, dtype)
    if ctx.auto():
        return jax.lax.with_sharding_constraint(z, spec)
    return jax.sharding.reshard(z, spec)


def momentum_dtype(mu_dtype, param_dtype) -> jnp.dtype:
    """``mu_dtype`` if given, else float16 for 16-bit (bfloat16, float16) parameters and
    the parameter's own dtype promoted to float32 otherwise.

    Dion3's momentum sums the gradients of a row until the row is selected, so a rarely selected
    row accumulates many of them. A 16-bit momentum is rounded stochastically to keep that sum
    unbiased, and a float16 one is stored with a power-of-two scale per leaf to keep it within
    float16's range (``dion3_jax._storage``). float16 is the 16-bit parameters' default because
    it trained like float32 in the quality study while saving 2 bytes per matrix entry;
    docs/HYPERPARAMETERS.md, "Momentum dtype", has what each dtype costs and saves
    (``benchmarks/momentum_dtype.py``, the quality study, the step's time and memory).
    """
    if mu_dtype is not None:
        return jnp.dtype(mu_dtype)
    if jnp.dtype(param_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return jnp.dtype(jnp.float16)
    return jnp.promote_types(param_dtype, jnp.float32)


def _check_floating(tree, what: str) -> None:
    """Raises a ValueError naming every leaf of ``tree`` that is not real floating."""
    bad = [f"{jax.tree_util.keystr(path)} has dtype {jnp.result_type(x)}"
           for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
           if not jnp.issubdtype(jnp.result_type(x), jnp.floating)]
    if bad:
        raise ValueError(f"Dion3 needs real floating {what}; {', '.join(bad)}. Complex "
                         "leaves go to the scalar optimizer (docs/ROUTING.md, complex parameters)")


def _check_like_state(updates, momentum) -> None:
    """The gradient tree must match the state's: else a ValueError naming the first bad leaf."""
    got = jax.tree_util.tree_flatten_with_path(updates)[0]
    want = jax.tree_util.tree_flatten_with_path(momentum)[0]
    for (gp, g), (mp, m) in zip(got, want):
        if gp != mp:
            raise ValueError(f"the gradient tree does not match the optimizer state: gradient leaf "
                             f"{jax.tree_util.keystr(gp)} where the state has "
                             f"{jax.tree_util.keystr(mp)}")
        if jnp.shape(g) != jnp.shape(m):
            raise ValueError(f"gradient {jax.tree_util.keystr(gp)} has shape {jnp.shape(g)}; the "
                             f"optimizer state was built for {jnp.shape(m)}")
    structure: _TreeDef = jax.tree.structure(updates)
    if len(got) != len(want) or structure != jax.tree.structure(momentum):
        extra = got[len(want):] or want[len(got):]
        where = jax.tree_util.keystr(extra[0][0]) if extra else "a container node"
        raise ValueError(f"the gradient tree does not match the optimizer state: {len(got)} "
                         f"gradient leaves, {len(want)} in the state (first difference: {where})")
    _check_floating(updates, "gradients")


def _check_bounds(state: ScaleByDion3State) -> None:
    """A float16 momentum needs its storage bound (:mod:`dion3_jax._storage`): without one the
    step could not choose its write scale, so a state without ``momentum_bound`` (one built by
    hand, or restored from before the field existed) is refused, naming the first such leaf."""
    if state.momentum_bound is not None:
        return
    for path, m in jax.tree_util.tree_flatten_with_path(state.momentum)[0]:
        if _storage.scaled(m.dtype):
            raise ValueError(
                f"momentum{jax.tree_util.keystr(path)} is float16 but the state's momentum_bound "
                "is None; rebuild the state with init, or set momentum_bound to float32 zeros "
                "shaped () per leaf (0: no bound yet, so the next write is unscaled and sets it)")


def _init(cfg: Dion3Config, params) -> ScaleByDion3State:
    _check_floating(params, "parameters")
    ctx, plans = _plan.leaf_plans(cfg, params)
    treedef: _TreeDef
    leaves, treedef = jax.tree.flatten(params)
    normuon = cfg.flavor == "normuon"
    commit = any_committed(params)
    mom, var, scale = [], [], []
    for p, pl in zip(leaves, plans):
        mom.append(_zeros(p.shape, momentum_dtype(cfg.mu_dtype, p.dtype), p, pl.spec, ctx, commit))
        # The momentum's row factors d start at 1 (placed like the second moments).
        scale.append(_zeros(pl.layout.variance_shape, jnp.float32, p, pl.var_spec, ctx, commit)
                     + 1)
        if normuon:
            var.append(_zeros(pl.layout.variance_shape, jnp.float32, p, pl.var_spec, ctx, commit))
    # Placed like the momentum, so the first jitted update compiles once.
    count = (_zeros((), jnp.int32, leaves[0], jax.P(), ctx, commit) if leaves
             else jnp.zeros([], jnp.int32))
    # The per-row state's Flax Variables must not shard its size-1 reduction axes.
    axes = [pl.layout.reduction_axes for pl in plans]
    # A float16 momentum's storage bounds (0: the first step reads the gradients').
    bound = None
    if any(_storage.scaled(m.dtype) for m in mom):
        bound = _param_metadata.scalar_state_tree(
            params, [_zeros((), jnp.float32, p, jax.P(), ctx, commit) for p in leaves])
    return ScaleByDion3State(
        count=count, momentum=treedef.unflatten(mom),
        variance=_param_metadata.row_state_tree(params, var, axes) if normuon else None,
        momentum_scale=_param_metadata.row_state_tree(params, scale, axes),
        momentum_bound=bound)


def _plan_key(grads, moms) -> tuple:
    """What the plan depends on besides the config: structure, shapes, dtypes, shardings, mesh."""
    leaves, treedef = jax.tree.flatten(grads)
    shardings = []
    for x in leaves:
        try:
            shardings.append(jax.typeof(x).sharding)
        except TypeError:
            shardings.append(None)
    return (treedef, tuple((tuple(x.shape), jnp.dtype(x.dtype)) for x in leaves),
            tuple(jnp.dtype(m.dtype) for m in moms), tuple(shardings),
            jax.sharding.get_abstract_mesh())


def _update(cfg: Dion3Config, plans: dict, updates, state: ScaleByDion3State):
    _check_like_state(updates, state.momentum)
    _check_bounds(state)
    treedef: _TreeDef = jax.tree.structure(updates)
    grads = treedef.flatten_up_to(updates)
    moms = treedef.flatten_up_to(state.momentum)
    normuon = cfg.flavor == "normuon"
    vars_in = treedef.flatten_up_to(state.variance) if normuon else []
    scales = treedef.flatten_up_to(state.momentum_scale)
    bounded = state.momentum_bound is not None
    bounds_in = treedef.flatten_up_to(state.momentum_bound) if bounded else []
    key = _plan_key(updates, moms)
    if key not in plans:
        plans[key] = _plan.build_plan(cfg, updates, [m.dtype for m in moms])
    plan = plans[key]

    coefficients = _step.Coefficients(cfg.mu, cfg.beta2)

    def step(g, m, v, d, b, count):
        u, m, v, d, b = _step.step(plan, coefficients, g, m, v if normuon else [None] * len(g),
                                   d, count, b if bounded else None)
        return u, m, v, d, b if bounded else []

    if plan.ctx.distributed:
        specs = [lp.spec for lp in plan.leaves]
        rspecs = [lp.var_spec for lp in plan.leaves]
        vspecs = rspecs if normuon else []
        bspecs = [jax.P()] * len(bounds_in)
        step = _distributed.shard_map(plan.ctx, step,
                                      in_specs=(specs, specs, vspecs, rspecs, bspecs, jax.P()),
                                      out_specs=(specs, specs, vspecs, rspecs, bspecs))
    new_u, new_m, new_v, new_d, new_b = step(list(grads), list(moms), list(vars_in),
                                             list(scales), list(bounds_in), state.count)
    new_state = ScaleByDion3State(
        count=jnp.asarray(optax.safe_increment(state.count)), momentum=treedef.unflatten(new_m),
        variance=treedef.unflatten(new_v) if normuon else None,
        momentum_scale=treedef.unflatten(new_d),
        momentum_bound=treedef.unflatten(new_b) if bounded else None)
    return treedef.unflatten(new_u), new_state


def scale_by_dion3(
    fraction: float | Fraction = Fraction(1, 4),
    mu: jax.typing.ArrayLike | None = None,
    beta2: jax.typing.ArrayLike = 0.95,
    *,
    flavor: Flavor = "normuon",
    adjust_lr: AdjustLR = "spectral_norm",
    dimension_numbers: PerLeaf[DimensionNumbers | None] | None = None,
    num_heads: PerLeaf[int | None] | None = None,
    split_sizes: PerLeaf[tuple[int, ...] | None] | None = None,
    mu_dtype: jax.typing.DTypeLike | None = None,
    orthogonalizer: Orthogonalizer | Callable[[jax.Array], jax.Array] | None = None,
    mesh_options: MeshOptions | None = None,
    pass_implementation: PassImplementation = "auto",
) -> optax.GradientTransformation:
    r"""Dion3's orthogonal update direction for matrix parameters (before learning rate and decay).

    Every leaf of the tree it sees must be a matrix (rank ≥ 2; use :func:`dion3_jax.dion3` to
    route the other leaves to AdamW). See the module docstring for the per-step rule. With
    ``fraction=1`` every row is selected every step and the rule is Muon / NorMuon with momentum
    ``U_t = μ·U_{t−1} + G_t`` (no Nesterov).

    Args:
      fraction: static fraction ``f`` in ``(0, 1]`` of rows orthogonalized per step; each matrix
        selects ``k = max(1, ceil(f·n))`` of its ``n`` output rows. Not injectable (it fixes
        shapes): the default ``Fraction(1, 4)`` (0.25) and any ``fractions.Fraction`` stay
        static under ``optax.inject_hyperparams``, which injects ints, floats and arrays; a
        float needs ``static_args=("fraction",)``.
      mu: error-feedback decay of the selected rows (the momentum coefficient at ``f = 1``).
        Default ``None``: ``0.95^(1/f)`` (:func:`dion3_jax.momentum_for_fraction`: the same
        memory per row as momentum 0.95 at ``f = 1``; 0.8145 at ``f = 1/4``). Pass ``mu=0.95``
        for the reference's constant default.
      beta2: EMA coefficient of the NorMuon per-row second moment. ``fraction``, ``mu`` and
        ``beta2`` are numbers (Python or NumPy scalars); ``mu`` and ``beta2`` may also be arrays
        (``optax.inject_hyperparams``). Schedules are not supported for ``mu`` and ``beta2``: a
        callable raises a ``ValueError`` at construction.
      flavor: ``"normuon"`` (row-normalized, the Dion3 default) or ``"muon"`` (plain polar).
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
      mu_dtype: dtype of the momentum. Default: float16 for 16-bit parameters, else each
        parameter's dtype. A bfloat16 or float16 momentum is rounded stochastically, and a
        float16 one stored with a power-of-two scale per leaf (docs/HYPERPARAMETERS.md).
      orthogonalizer: the polar operator: ``None`` (Gram Newton-Schulz, Polar Express
        coefficients, restart at step 2, float16, fastest kernel backend), an
        :class:`dion3_jax.Orthogonalizer` from :func:`dion3_jax.make_orthogonalizer`, or any
        callable mapping a ``(batch, rows, cols)`` array to its polar factors.
      mesh_options: :class:`dion3_jax.MeshOptions` for a device mesh (FSDP axes, compressed
        sync over a replica axis, selection scope); default: the ambient mesh, if any, with
        every axis an FSDP axis. Under ``jit`` with a mesh the step runs in one
        ``jax.shard_map`` and each leaf keeps its sharding (``docs/DISTRIBUTED.md``).
      pass_implementation: what runs the step's two memory-bound passes over the momentum (the
        statistics pass :func:`pallas_kernels.accumulate_rows` and the payload pass
        :func:`pallas_kernels.stack_payloads`): ``"xla"`` (XLA's fusions, every platform),
        ``"mosaic"`` (Pallas Mosaic GPU kernels, Hopper: the statistics pass, and the payload
        pass of groups whose every row is selected; the payload of selected rows in XLA,
        whose speed it matches; every shape group's local matrices must then have a multiple
        of 64 along axis 1), ``"pallas_triton"`` (both as Pallas kernels through Pallas'
        Triton lowering, NVIDIA GPUs; jax 0.11 deprecates it and prints a
        ``DeprecationWarning`` when the step compiles) or ``"auto"``: per pass and shape
        group, the Mosaic kernel on Hopper where it takes the group (the fastest on the
        7B-shapes step, docs/KERNELS.md), else XLA (other GPUs, TPUs, CPUs). A named kernel
        that does not take a group's shape raises ``ValueError``. Independent of the
        orthogonalizer's ``backend``, which picks the polar's products.

    Returns:
      An ``optax.GradientTransformation`` with state :class:`ScaleByDion3State`. Its updates
      have each gradient's dtype promoted to float32 (float32 for 16-bit gradients, which keeps
      the update's own rounding out of 16-bit parameters: ``optax.apply_updates`` rounds once).

    Raises:
      ValueError: for an invalid hyperparameter or distribution option (at construction), a
        leaf that is not a matrix, an unsupported sharding or a mesh axis that does not exist
        (at init / update).
      TypeError: for an argument of the wrong type (at construction).

    References:
      Amsel et al., `Dion3: Full-Stack Orthogonal Updates <https://arxiv.org/abs/2608.11612>`_,
      2026.
    """
    cfg = make_config(fraction, mu, beta2, flavor, adjust_lr, dimension_numbers, num_heads,
                      split_sizes, mu_dtype, orthogonalizer, mesh_options, pass_implementation)
    plans: dict = {}

    def init_fn(params):
        return _init(cfg, params)

    def update_fn(updates, state, params=None):
        del params
        return _update(cfg, plans, updates, state)

    return optax.GradientTransformation(init_fn, update_fn)
