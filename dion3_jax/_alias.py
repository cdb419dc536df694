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
"""Ready-to-use optimizers: ``dion3``, ``muon``, ``normuon`` (matrices) + AdamW/Lion (the rest).

Only hidden-layer matrices are orthogonalized. Biases, norms and other non-matrix leaves — and the
token embedding and the LM head, which are 2-D but are NOT matrices in this sense (their rows are
lookup tables / class scores, not a linear map between hidden spaces) — go to a scalar optimizer
through ``optax.partition``.

Each of the three optimizers writes out its parameters in its own ``def`` (so that type checkers,
IDEs and ``typing.get_type_hints`` see them; no ``from __future__ import annotations`` here, the
annotations are objects) and passes every one to the one builder, :func:`_build`.
``tests/test_signatures.py`` keeps their shared options the same (names, order, defaults,
annotations) and checks that each is forwarded.
"""

from collections.abc import Callable
from fractions import Fraction
import math
from typing import Literal

import jax
import optax

from dion3_jax._config import AdjustLR, Flavor, PassImplementation, check_range
from dion3_jax._distributed import MeshOptions
from dion3_jax._layout import DimensionNumbers
from dion3_jax._orthogonalizer import Orthogonalizer
from dion3_jax._routing import DION3_LABEL, SCALAR_LABEL, default_param_labels
from dion3_jax._transform import any_committed, scale_by_dion3
from dion3_jax._types import Label, Mask, Params, PerLeaf, Tree


def transfer_learning_rate(learning_rate: float, from_fraction: float, to_fraction: float
                           ) -> float:
    """Moves a tuned learning rate to another fraction with the paper's rule ``lr ∝ 1/√f``.

    Args:
      learning_rate: learning rate tuned at ``from_fraction``.
      from_fraction: the fraction it was tuned at.
      to_fraction: the new fraction.

    Returns:
      ``learning_rate · √(from_fraction / to_fraction)``, which keeps ``lr·√f`` constant.

    Examples:
      >>> from dion3_jax import transfer_learning_rate
      >>> round(transfer_learning_rate(0.01, 1.0, 0.25), 6)
      0.02
    """
    for name, f in (("from_fraction", from_fraction), ("to_fraction", to_fraction)):
        if not 0.0 < float(f) <= 1.0:
            raise ValueError(f"{name} must be in (0, 1], got {name}={f!r}")
    return learning_rate * math.sqrt(from_fraction / to_fraction)


def _build(
    learning_rate: optax.ScalarOrSchedule,
    fraction: float | Fraction,
    mu: jax.typing.ArrayLike | None,
    beta2: jax.typing.ArrayLike,
    weight_decay: optax.ScalarOrSchedule,
    weight_decay_mask: Mask | None,
    *,
    flavor: Flavor,
    adjust_lr: AdjustLR,
    dimension_numbers: PerLeaf[DimensionNumbers | None] | None,
    num_heads: PerLeaf[int | None] | None,
    split_sizes: PerLeaf[tuple[int, ...] | None] | None,
    mu_dtype: jax.typing.DTypeLike | None,
    orthogonalizer: Orthogonalizer | Callable[[jax.Array], jax.Array] | None,
    mesh_options: MeshOptions | None,
    pass_implementation: PassImplementation,
    param_labels: PerLeaf[Label] | None,
    scalar_optimizer: Literal["adamw", "lion"],
    adam_learning_rate: optax.ScalarOrSchedule | None,
    adam_b1: jax.typing.ArrayLike,
    adam_b2: jax.typing.ArrayLike,
    adam_eps: jax.typing.ArrayLike,
    adam_weight_decay: optax.ScalarOrSchedule,
    adam_weight_decay_mask: Mask | None,
) -> optax.GradientTransformationExtraArgs:
    """The one builder of :func:`dion3`, :func:`muon` and :func:`normuon` (documented there).

    It has no defaults: each public optimizer passes every argument, so one that it forgot to
    forward fails at the call (``tests/test_signatures.py`` checks that they forward each).
    """
    _check_alias_args(learning_rate, weight_decay, adam_learning_rate, adam_b1, adam_b2,
                      adam_eps, adam_weight_decay, scalar_optimizer)
    matrix_tx = optax.chain(
        scale_by_dion3(fraction, mu, beta2, flavor=flavor, adjust_lr=adjust_lr,
                       dimension_numbers=dimension_numbers, num_heads=num_heads,
                       split_sizes=split_sizes, mu_dtype=mu_dtype,
                       orthogonalizer=orthogonalizer, mesh_options=mesh_options,
                       pass_implementation=pass_implementation),
        _with_params_in_update_dtype(optax.add_decayed_weights(weight_decay, weight_decay_mask)),
        optax.scale_by_learning_rate(learning_rate),
    )
    scalar_lr = learning_rate if adam_learning_rate is None else adam_learning_rate
    if scalar_optimizer == "adamw":
        scalar_tx = optax.adamw(scalar_lr, b1=adam_b1, b2=adam_b2, eps=adam_eps,
                                weight_decay=adam_weight_decay, mask=adam_weight_decay_mask)
    else:
        scalar_tx = optax.lion(scalar_lr, b1=adam_b1, b2=adam_b2, weight_decay=adam_weight_decay,
                               mask=adam_weight_decay_mask)
    labels: PerLeaf[Label]
    if param_labels is None:
        def labels(params: Params) -> Tree[Label]:
            return default_param_labels(params, dimension_numbers)
    else:
        labels = param_labels
    return _committed_counts(
        optax.partition({DION3_LABEL: matrix_tx, SCALAR_LABEL: scalar_tx}, labels))


def dion3(
    learning_rate: optax.ScalarOrSchedule,
    fraction: float | Fraction = Fraction(1, 4),
    mu: jax.typing.ArrayLike | None = None,
    beta2: jax.typing.ArrayLike = 0.95,
    weight_decay: optax.ScalarOrSchedule = 0.01,
    weight_decay_mask: Mask | None = None,
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
    param_labels: PerLeaf[Label] | None = None,
    scalar_optimizer: Literal["adamw", "lion"] = "adamw",
    adam_learning_rate: optax.ScalarOrSchedule | None = None,
    adam_b1: jax.typing.ArrayLike = 0.9,
    adam_b2: jax.typing.ArrayLike = 0.95,
    adam_eps: jax.typing.ArrayLike = 1e-8,
    adam_weight_decay: optax.ScalarOrSchedule = 0.0,
    adam_weight_decay_mask: Mask | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Dion3 for matrix parameters, AdamW (or Lion) for everything else.

    Matrix leaves get :func:`dion3_jax.scale_by_dion3`, then decoupled weight decay and the
    learning rate: ``W ← W − lr·(wd·W + scale·D)`` on the selected rows, ``W ← W − lr·wd·W``
    elsewhere. Other leaves get ``optax.adamw`` (or ``optax.lion``).

    The matrices' updates are float32 for 16-bit (bfloat16, float16) parameters and already
    hold the decay and the learning rate, both computed in float32; ``optax.apply_updates`` adds
    them to the parameter in float32 and rounds once: ``W_new`` is the 16-bit rounding of the
    float32 value ``(1 − lr·wd)·W − lr·scale·D``. Updates of float32 parameters are float32.
    To skip steps with non-finite gradients, wrap it in :func:`dion3_jax.apply_if_finite`
    (``optax.apply_if_finite`` answers with zeros of the gradients' dtype and, with 16-bit
    parameters, fails to trace).

    .. warning::
      Embeddings and the LM head (unembedding) are 2-D but must not be orthogonalized. The
      default labels send leaves with a path component that
      :data:`dion3_jax.routing.DEFAULT_SCALAR_PATTERN` matches as a whole (``embed``,
      ``token_embedding``, ``lm_head``, ``head``, ``wte``, ``wpe``, ...) to the scalar
      optimizer; name yours accordingly or pass ``param_labels``.

    Args:
      learning_rate: base learning rate or schedule (Dion3 default in the reference: 0.01–0.02).
      fraction: static fraction of rows orthogonalized per step, in ``(0, 1]``; see
        :func:`transfer_learning_rate` to move a learning rate between fractions. The default
        is ``Fraction(1, 4)`` (0.25) so that ``optax.inject_hyperparams`` leaves it static
        (it injects ints, floats and arrays): pass a ``fractions.Fraction`` too, or a float
        with ``static_args=("fraction",)``.
      mu: error-feedback decay (momentum at ``f = 1``); default ``0.95^(1/f)``, see
        :func:`dion3_jax.momentum_for_fraction` (``mu=0.95`` is the reference's default).
      beta2: NorMuon second-moment EMA coefficient. ``mu`` and ``beta2`` are numbers (Python or
        NumPy scalars) or arrays (``optax.inject_hyperparams``), not schedules: a callable raises
        a ``ValueError`` at construction (as it does for ``adam_b1``, ``adam_b2``, ``adam_eps``).
      weight_decay: decoupled weight decay of the matrices, applied with the base learning rate.
      weight_decay_mask: optional mask (tree or callable) for the matrices' weight decay.
      flavor: ``"normuon"`` (row-normalized, the Dion3 default) or ``"muon"`` (plain polar).
      adjust_lr: the per-matrix learning-rate shape factor, ``"spectral_norm"``, ``"rms_norm"``
        or ``None`` (:func:`scale_by_dion3`).
      dimension_numbers: which axes of each leaf are its matrix's ``(reduction_axis,
        output_axis)`` (:func:`scale_by_dion3`); also read by the default labels.
      num_heads: per-head matrices (:func:`scale_by_dion3`).
      split_sizes: independent row blocks of the output axis, e.g. fused QKV
        (:func:`scale_by_dion3`).
      mu_dtype: dtype of the momentum; default float16 for 16-bit parameters, else each
        parameter's (:func:`scale_by_dion3`).
      orthogonalizer: the polar operator: ``None`` (the default Gram Newton-Schulz), a
        :func:`dion3_jax.make_orthogonalizer` record or a callable (:func:`scale_by_dion3`).
      mesh_options: :class:`dion3_jax.MeshOptions` for a device mesh (:func:`scale_by_dion3`).
      pass_implementation: what runs the step's two passes over the momentum, ``"auto"``,
        ``"xla"``, ``"mosaic"`` or ``"pallas_triton"`` (:func:`scale_by_dion3`).
      param_labels: tree or callable of ``"dion3"`` / ``"scalar"`` labels; default
        :func:`default_param_labels`.
      scalar_optimizer: ``"adamw"`` or ``"lion"`` for the non-matrix leaves.
      adam_learning_rate: learning rate of the scalar optimizer. Default ``None`` reuses
        ``learning_rate`` (as the reference does), which is large for AdamW when the Dion3 rate
        is 0.01–0.04: set it explicitly (e.g. 1e-3–8e-3) in practice.
      adam_b1: the scalar optimizer's first-moment decay (Lion's ``b1``).
      adam_b2: the scalar optimizer's second-moment decay (Lion's ``b2``).
      adam_eps: AdamW's epsilon (Lion has none).
      adam_weight_decay: weight decay of the scalar optimizer (all its leaves, norm scales
        included, unless masked).
      adam_weight_decay_mask: optional mask (tree or callable) for it, e.g. to exclude norms.

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> import dion3_jax
      >>> params = {"w": jnp.ones((64, 32)), "b": jnp.zeros((32,))}
      >>> tx = dion3_jax.dion3(learning_rate=0.02, fraction=0.25)
      >>> state = tx.init(params)
      >>> grads = jax.tree.map(jnp.ones_like, params)
      >>> updates, state = jax.jit(tx.update)(grads, state, params)
      >>> params = optax.apply_updates(params, updates)

    References:
      Amsel et al., `Dion3: Full-Stack Orthogonal Updates <https://arxiv.org/abs/2608.11612>`_,
      2026.
    """
    return _build(
        learning_rate, fraction, mu, beta2, weight_decay, weight_decay_mask,
        flavor=flavor, adjust_lr=adjust_lr, dimension_numbers=dimension_numbers,
        num_heads=num_heads, split_sizes=split_sizes, mu_dtype=mu_dtype,
        orthogonalizer=orthogonalizer, mesh_options=mesh_options,
        pass_implementation=pass_implementation, param_labels=param_labels,
        scalar_optimizer=scalar_optimizer, adam_learning_rate=adam_learning_rate,
        adam_b1=adam_b1, adam_b2=adam_b2, adam_eps=adam_eps,
        adam_weight_decay=adam_weight_decay, adam_weight_decay_mask=adam_weight_decay_mask)


def muon(
    learning_rate: optax.ScalarOrSchedule,
    mu: jax.typing.ArrayLike | None = 0.95,
    weight_decay: optax.ScalarOrSchedule = 0.01,
    weight_decay_mask: Mask | None = None,
    *,
    adjust_lr: AdjustLR = "spectral_norm",
    dimension_numbers: PerLeaf[DimensionNumbers | None] | None = None,
    num_heads: PerLeaf[int | None] | None = None,
    split_sizes: PerLeaf[tuple[int, ...] | None] | None = None,
    mu_dtype: jax.typing.DTypeLike | None = None,
    orthogonalizer: Orthogonalizer | Callable[[jax.Array], jax.Array] | None = None,
    mesh_options: MeshOptions | None = None,
    pass_implementation: PassImplementation = "auto",
    param_labels: PerLeaf[Label] | None = None,
    scalar_optimizer: Literal["adamw", "lion"] = "adamw",
    adam_learning_rate: optax.ScalarOrSchedule | None = None,
    adam_b1: jax.typing.ArrayLike = 0.9,
    adam_b2: jax.typing.ArrayLike = 0.95,
    adam_eps: jax.typing.ArrayLike = 1e-8,
    adam_weight_decay: optax.ScalarOrSchedule = 0.0,
    adam_weight_decay_mask: Mask | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Muon (momentum ``U = μU + G``, no Nesterov) through the Dion3 code path at ``f = 1``.

    :func:`dion3` with ``fraction=1`` and ``flavor="muon"``: every row is selected every step
    and its polar factor is the update. The options after ``*`` are :func:`dion3`'s (same
    names, defaults and meaning).

    Args:
      learning_rate: base learning rate or schedule.
      mu: momentum coefficient (a number or an array, not a schedule).
      weight_decay: decoupled weight decay of the matrices.
      weight_decay_mask: optional mask (tree or callable) for it.
      adjust_lr: the per-matrix learning-rate shape factor.
      dimension_numbers: the ``(reduction_axis, output_axis)`` of each leaf's matrix.
      num_heads: per-head matrices.
      split_sizes: independent row blocks of the output axis (fused QKV).
      mu_dtype: dtype of the momentum.
      orthogonalizer: the polar operator.
      mesh_options: :class:`dion3_jax.MeshOptions` for a device mesh.
      pass_implementation: what runs the step's two passes over the momentum.
      param_labels: tree or callable of ``"dion3"`` / ``"scalar"`` labels.
      scalar_optimizer: ``"adamw"`` or ``"lion"`` for the non-matrix leaves.
      adam_learning_rate: learning rate of the scalar optimizer (default: ``learning_rate``).
      adam_b1: the scalar optimizer's first-moment decay.
      adam_b2: the scalar optimizer's second-moment decay.
      adam_eps: AdamW's epsilon.
      adam_weight_decay: weight decay of the scalar optimizer.
      adam_weight_decay_mask: optional mask for it.

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    References:
      Jordan et al., `Muon <https://kellerjordan.github.io/posts/muon/>`_, 2024.
    """
    return _build(
        learning_rate, 1.0, mu, 0.95, weight_decay, weight_decay_mask,
        flavor="muon", adjust_lr=adjust_lr, dimension_numbers=dimension_numbers,
        num_heads=num_heads, split_sizes=split_sizes, mu_dtype=mu_dtype,
        orthogonalizer=orthogonalizer, mesh_options=mesh_options,
        pass_implementation=pass_implementation, param_labels=param_labels,
        scalar_optimizer=scalar_optimizer, adam_learning_rate=adam_learning_rate,
        adam_b1=adam_b1, adam_b2=adam_b2, adam_eps=adam_eps,
        adam_weight_decay=adam_weight_decay, adam_weight_decay_mask=adam_weight_decay_mask)


def normuon(
    learning_rate: optax.ScalarOrSchedule,
    mu: jax.typing.ArrayLike | None = 0.95,
    beta2: jax.typing.ArrayLike = 0.95,
    weight_decay: optax.ScalarOrSchedule = 0.01,
    weight_decay_mask: Mask | None = None,
    *,
    adjust_lr: AdjustLR = "spectral_norm",
    dimension_numbers: PerLeaf[DimensionNumbers | None] | None = None,
    num_heads: PerLeaf[int | None] | None = None,
    split_sizes: PerLeaf[tuple[int, ...] | None] | None = None,
    mu_dtype: jax.typing.DTypeLike | None = None,
    orthogonalizer: Orthogonalizer | Callable[[jax.Array], jax.Array] | None = None,
    mesh_options: MeshOptions | None = None,
    pass_implementation: PassImplementation = "auto",
    param_labels: PerLeaf[Label] | None = None,
    scalar_optimizer: Literal["adamw", "lion"] = "adamw",
    adam_learning_rate: optax.ScalarOrSchedule | None = None,
    adam_b1: jax.typing.ArrayLike = 0.9,
    adam_b2: jax.typing.ArrayLike = 0.95,
    adam_eps: jax.typing.ArrayLike = 1e-8,
    adam_weight_decay: optax.ScalarOrSchedule = 0.0,
    adam_weight_decay_mask: Mask | None = None,
) -> optax.GradientTransformationExtraArgs:
    """NorMuon (row-normalized Muon) through the Dion3 code path at ``f = 1``.

    :func:`dion3` with ``fraction=1`` and ``flavor="normuon"``. The options after ``*`` are
    :func:`dion3`'s (same names, defaults and meaning).

    Args:
      learning_rate: base learning rate or schedule.
      mu: momentum coefficient (a number or an array, not a schedule).
      beta2: second-moment EMA coefficient (a number or an array, not a schedule).
      weight_decay: decoupled weight decay of the matrices.
      weight_decay_mask: optional mask (tree or callable) for it.
      adjust_lr: the per-matrix learning-rate shape factor.
      dimension_numbers: the ``(reduction_axis, output_axis)`` of each leaf's matrix.
      num_heads: per-head matrices.
      split_sizes: independent row blocks of the output axis (fused QKV).
      mu_dtype: dtype of the momentum.
      orthogonalizer: the polar operator.
      mesh_options: :class:`dion3_jax.MeshOptions` for a device mesh.
      pass_implementation: what runs the step's two passes over the momentum.
      param_labels: tree or callable of ``"dion3"`` / ``"scalar"`` labels.
      scalar_optimizer: ``"adamw"`` or ``"lion"`` for the non-matrix leaves.
      adam_learning_rate: learning rate of the scalar optimizer (default: ``learning_rate``).
      adam_b1: the scalar optimizer's first-moment decay.
      adam_b2: the scalar optimizer's second-moment decay.
      adam_eps: AdamW's epsilon.
      adam_weight_decay: weight decay of the scalar optimizer.
      adam_weight_decay_mask: optional mask for it.

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    References:
      Li et al., `NorMuon <https://arxiv.org/abs/2510.05491>`_, 2025.
    """
    return _build(
        learning_rate, 1.0, mu, beta2, weight_decay, weight_decay_mask,
        flavor="normuon", adjust_lr=adjust_lr, dimension_numbers=dimension_numbers,
        num_heads=num_heads, split_sizes=split_sizes, mu_dtype=mu_dtype,
        orthogonalizer=orthogonalizer, mesh_options=mesh_options,
        pass_implementation=pass_implementation, param_labels=param_labels,
        scalar_optimizer=scalar_optimizer, adam_learning_rate=adam_learning_rate,
        adam_b1=adam_b1, adam_b2=adam_b2, adam_eps=adam_eps,
        adam_weight_decay=adam_weight_decay, adam_weight_decay_mask=adam_weight_decay_mask)


def _with_params_in_update_dtype(tx: optax.GradientTransformation
                                 ) -> optax.GradientTransformation:
    """``tx`` that sees each parameter cast to its update's dtype.

    The matrices' updates are float32 for 16-bit parameters (:func:`scale_by_dion3`), so the
    weight decay ``wd·W`` is then computed in float32 too (``optax.add_decayed_weights`` alone
    would round it to the parameter's dtype first). A no-op for float32 parameters.
    """
    def update_fn(updates, state, params=None):
        if params is not None:
            params = jax.tree.map(lambda u, p: p.astype(u.dtype), updates, params)
        return tx.update(updates, state, params)

    return optax.GradientTransformation(tx.init, update_fn)


def _replicated_like(params):
    """A sharding that puts a scalar where the params live (None when none is committed)."""
    if not any_committed(params):
        return None
    for x in jax.tree.leaves(params):
        sharding = getattr(x, "sharding", None)
        if isinstance(x, jax.core.Tracer) or sharding is None:
            continue
        if isinstance(sharding, jax.sharding.NamedSharding):
            return jax.sharding.NamedSharding(sharding.mesh, jax.P())
        if len(sharding.device_set) == 1:
            return jax.sharding.SingleDeviceSharding(next(iter(sharding.device_set)))
    return None


def _committed_counts(tx: optax.GradientTransformationExtraArgs
                      ) -> optax.GradientTransformationExtraArgs:
    """``tx`` whose ``init`` places its scalar state (optax's step counts) like the params.

    optax creates counts uncommitted. With committed params the first jitted ``update`` would
    then see other argument placements than the second (whose state came out of jit, committed)
    and compile twice; with uncommitted params every state leaf stays uncommitted.
    """
    def init_fn(params):
        state = tx.init(params)
        place = _replicated_like(params)
        if place is None:
            return state
        return jax.tree.map(lambda x: jax.device_put(x, place) if (
            isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.ndim == 0)
            else x, state)

    return optax.GradientTransformationExtraArgs(init_fn, tx.update)


def _check_alias_args(learning_rate, weight_decay, adam_learning_rate, adam_b1, adam_b2,
                      adam_eps, adam_weight_decay, scalar_optimizer) -> None:
    """Construction-time checks of :func:`dion3`'s own arguments (finite, in range, typed)."""
    check_range("learning_rate", learning_rate, 0.0, math.inf, hi_open=True, schedule=True)
    check_range("weight_decay", weight_decay, 0.0, math.inf, hi_open=True, schedule=True)
    check_range("adam_weight_decay", adam_weight_decay, 0.0, math.inf, hi_open=True, schedule=True)
    if adam_learning_rate is not None:
        check_range("adam_learning_rate", adam_learning_rate, 0.0, math.inf, hi_open=True,
                    schedule=True)
    check_range("adam_b1", adam_b1, 0.0, 1.0, hi_open=True)
    check_range("adam_b2", adam_b2, 0.0, 1.0, hi_open=True)
    check_range("adam_eps", adam_eps, 0.0, math.inf, hi_open=True)
    if scalar_optimizer not in ("adamw", "lion"):
        raise ValueError(f"scalar_optimizer must be 'adamw' or 'lion', got {scalar_optimizer=!r}")
