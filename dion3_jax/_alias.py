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

The three optimizers are made by :func:`_optimizer` from one builder, :func:`_build`, whose
keyword-only parameters are their options: each option is defined once, there.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
import inspect
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
from dion3_jax._types import Label, Mask, PerLeaf

Optimizer = optax.GradientTransformationExtraArgs


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
    """The one builder of :func:`dion3`, :func:`muon` and :func:`normuon` (documented there)."""
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
    if param_labels is None:
        def param_labels(params):
            return default_param_labels(params, dimension_numbers)
    return _committed_counts(
        optax.partition({DION3_LABEL: matrix_tx, SCALAR_LABEL: scalar_tx}, param_labels))


def _optimizer(**fixed) -> Callable[[Callable], Callable[..., Optimizer]]:
    """Makes a public optimizer from a stub: ``_build`` with the stub's signature.

    The stub (never called) gives the name, the docstring and the positional parameters with
    their defaults; ``fixed`` gives the values of ``_build``'s other parameters that the
    optimizer does not take. The optimizer's keyword-only parameters are the rest of
    ``_build``'s, and every annotation is ``_build``'s, so each option is defined once.

    Raises:
      TypeError: (at import) when the stub and ``fixed`` do not cover ``_build``'s parameters.
    """
    base = inspect.signature(_build)

    def make(stub: Callable) -> Callable[..., Optimizer]:
        own = inspect.signature(stub).parameters
        positional = [base.parameters[name].replace(default=p.default) for name, p in own.items()]
        keywords = [p for name, p in base.parameters.items()
                    if p.kind is p.KEYWORD_ONLY and name not in fixed and name not in own]
        sig = base.replace(parameters=positional + keywords)
        uncovered = set(base.parameters) - set(sig.parameters) - set(fixed)
        if uncovered or set(fixed) & set(sig.parameters):
            raise TypeError(f"{stub.__name__}: _build's {sorted(uncovered)} are neither taken "
                            f"nor fixed, or fixed {sorted(fixed)} are also taken")

        def optimizer(*args, **kwargs) -> Optimizer:
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            return _build(**bound.arguments, **fixed)

        for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
            setattr(optimizer, attr, getattr(stub, attr))
        optimizer.__signature__ = sig
        optimizer.__annotations__ = {
            **{p.name: p.annotation for p in sig.parameters.values()},
            "return": sig.return_annotation}
        return optimizer

    return make


@_optimizer()
def dion3(learning_rate, fraction=Fraction(1, 4), mu=None, beta2=0.95, weight_decay=0.01,
          weight_decay_mask=None):
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
      flavor, adjust_lr, dimension_numbers, num_heads, split_sizes, mu_dtype, orthogonalizer,
        mesh_options, pass_implementation: the matrix transform's options, see
        :func:`scale_by_dion3` (``mu_dtype`` defaults to float32 for 16-bit parameters).
      param_labels: tree or callable of ``"dion3"`` / ``"scalar"`` labels; default
        :func:`default_param_labels`.
      scalar_optimizer: ``"adamw"`` or ``"lion"`` for the non-matrix leaves.
      adam_learning_rate: learning rate of the scalar optimizer. Default ``None`` reuses
        ``learning_rate`` (as the reference does), which is large for AdamW when the Dion3 rate
        is 0.01–0.04: set it explicitly (e.g. 1e-3–8e-3) in practice.
      adam_b1, adam_b2, adam_eps: scalar optimizer's moments (Lion uses ``b1``, ``b2``).
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


@_optimizer(fraction=1.0, beta2=0.95, flavor="muon")
def muon(learning_rate, mu=0.95, weight_decay=0.01, weight_decay_mask=None):
    """Muon (momentum ``U = μU + G``, no Nesterov) through the Dion3 code path at ``f = 1``.

    Args:
      learning_rate: base learning rate or schedule.
      mu: momentum coefficient.
      weight_decay: decoupled weight decay of the matrices.
      weight_decay_mask: optional mask for it.
      adjust_lr, dimension_numbers, num_heads, split_sizes, mu_dtype, orthogonalizer,
        mesh_options, pass_implementation, param_labels, scalar_optimizer, adam_learning_rate,
        adam_b1, adam_b2, adam_eps, adam_weight_decay, adam_weight_decay_mask: as in
        :func:`dion3`.

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    References:
      Jordan et al., `Muon <https://kellerjordan.github.io/posts/muon/>`_, 2024.
    """


@_optimizer(fraction=1.0, flavor="normuon")
def normuon(learning_rate, mu=0.95, beta2=0.95, weight_decay=0.01, weight_decay_mask=None):
    """NorMuon (row-normalized Muon) through the Dion3 code path at ``f = 1``.

    Args:
      learning_rate: base learning rate or schedule.
      mu: momentum coefficient.
      beta2: second-moment EMA coefficient.
      weight_decay: decoupled weight decay of the matrices.
      weight_decay_mask: optional mask for it.
      adjust_lr, dimension_numbers, num_heads, split_sizes, mu_dtype, orthogonalizer,
        mesh_options, pass_implementation, param_labels, scalar_optimizer, adam_learning_rate,
        adam_b1, adam_b2, adam_eps, adam_weight_decay, adam_weight_decay_mask: as in
        :func:`dion3`.

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    References:
      Li et al., `NorMuon <https://arxiv.org/abs/2510.05491>`_, 2025.
    """


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
