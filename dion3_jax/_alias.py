"""Ready-to-use optimizers: ``dion3``, ``muon``, ``normuon`` (matrices) + AdamW/Lion (the rest).

Only hidden-layer matrices are orthogonalized. Biases, norms and other non-matrix leaves — and the
token embedding and the LM head, which are 2-D but are NOT matrices in this sense (their rows are
lookup tables / class scores, not a linear map between hidden spaces) — go to a scalar optimizer
through ``optax.partition``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import inspect
import math
import re
from typing import Any, Literal

import jax
import optax

from dion3_jax import _layout
from dion3_jax._transform import AdjustLR, Flavour, check_range, scale_by_dion3

DION3_LABEL = "dion3"
SCALAR_LABEL = "scalar"
#: Path components (lower-cased) that mark a 2-D leaf as an embedding or output head.
DEFAULT_SCALAR_PATTERN = r"embed|^wte$|^wpe$|^lm_head$|^head$|^unembed|^classifier$"


def default_param_labels(params: Any, dimension_numbers: Any = None,
                         scalar_pattern: str = DEFAULT_SCALAR_PATTERN) -> Any:
    """Labels each leaf ``"dion3"`` or ``"scalar"``.

    Rules: with ``dimension_numbers`` given as a tree or callable, a leaf with a
    ``DimensionNumbers`` is ``"dion3"`` and a leaf with ``None`` is ``"scalar"``. Otherwise a leaf
    is ``"dion3"`` when it is 2-D (any rank ≥ 2 if one ``DimensionNumbers`` is given for all)
    and no component of its key path matches ``scalar_pattern`` (embeddings, LM heads).

    Args:
      params: the parameter tree (dicts, ``nnx.State``, any pytree).
      dimension_numbers: as in :func:`dion3`.
      scalar_pattern: regular expression searched in each lower-cased path component.

    Returns:
      A tree of labels with the structure of ``params``.
    """
    pattern = re.compile(scalar_pattern)
    explicit = dimension_numbers is not None and (
        callable(dimension_numbers) or not _layout.is_single_value(dimension_numbers))
    lookup = _layout.per_leaf(dimension_numbers, params) if explicit else None

    def label(path, leaf):
        if explicit:
            return DION3_LABEL if lookup(path) is not None else SCALAR_LABEL
        ndim = len(leaf.shape)
        is_matrix = ndim == 2 or (dimension_numbers is not None and ndim >= 2)
        names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))).lower()
                 for k in path]
        if is_matrix and not any(pattern.search(n) for n in names):
            return DION3_LABEL
        return SCALAR_LABEL

    return jax.tree_util.tree_map_with_path(label, params)


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


def dion3(
    learning_rate: optax.ScalarOrSchedule,
    fraction: float = 0.25,
    mu: jax.typing.ArrayLike = 0.95,
    beta2: jax.typing.ArrayLike = 0.95,
    weight_decay: optax.ScalarOrSchedule = 0.01,
    weight_decay_mask: Any = None,
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
    param_labels: Any = None,
    scalar_optimizer: Literal["adamw", "lion"] = "adamw",
    adam_learning_rate: optax.ScalarOrSchedule | None = None,
    adam_b1: jax.typing.ArrayLike = 0.9,
    adam_b2: jax.typing.ArrayLike = 0.95,
    adam_eps: jax.typing.ArrayLike = 1e-8,
    adam_weight_decay: optax.ScalarOrSchedule = 0.0,
    adam_weight_decay_mask: Any = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Dion3 for matrix parameters, AdamW (or Lion) for everything else.

    Matrix leaves get :func:`dion3_jax.scale_by_dion3`, then decoupled weight decay and the
    learning rate: ``W ← W − lr·(wd·W + scale·D)`` on the selected rows, ``W ← W − lr·wd·W``
    elsewhere. Other leaves get ``optax.adamw`` (or ``optax.lion``).

    .. warning::
      Embeddings and the LM head (unembedding) are 2-D but must not be orthogonalized. The
      default labels send leaves whose path matches :data:`DEFAULT_SCALAR_PATTERN` (``embed``,
      ``lm_head``, ``head``, ``wte``, ...) to the scalar optimizer; name yours accordingly or pass
      ``param_labels``.

    Args:
      learning_rate: base learning rate or schedule (Dion3 default in the reference: 0.01–0.02).
      fraction: static fraction of rows orthogonalized per step, in ``(0, 1]``; see
        :func:`transfer_learning_rate` to move a learning rate between fractions.
      mu: error-feedback decay (momentum at ``f = 1``).
      beta2: NorMuon second-moment EMA coefficient.
      weight_decay: decoupled weight decay of the matrices, applied with the base learning rate.
      weight_decay_mask: optional mask (tree or callable) for the matrices' weight decay.
      flavour: ``"normuon"`` or ``"muon"``.
      adjust_lr: ``"spectral_norm"``, ``"rms_norm"`` or ``None`` (see :func:`scale_by_dion3`).
      dimension_numbers: per-leaf :class:`dion3_jax.DimensionNumbers` (one value, a tree or a
        callable); default: 2-D Flax ``(in, out)`` kernels.
      num_heads: per-head orthogonalization (one int, a tree or a callable).
      split_sizes: independent row blocks, e.g. fused QKV (a tuple, a tree or a callable).
      mu_dtype: momentum dtype (default: the params' dtype).
      orthogonalizer: custom ``(batch, rows, cols) -> polar factors`` callable.
      method, coefficients, restarts, compute_dtype, backend: :func:`dion3_jax.polar` options.
      mesh, shard_axis, replica_axis, selection_scope, replica_selection, seed, param_specs:
        distribution options, passed to :func:`scale_by_dion3` (see ``docs/DISTRIBUTED.md``).
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
    check_range("weight_decay", weight_decay, 0.0, math.inf)
    check_range("adam_weight_decay", adam_weight_decay, 0.0, math.inf)
    check_range("learning_rate", learning_rate, 0.0, math.inf)
    if adam_learning_rate is not None:
        check_range("adam_learning_rate", adam_learning_rate, 0.0, math.inf)
    check_range("adam_b1", adam_b1, 0.0, 1.0, hi_open=True)
    check_range("adam_b2", adam_b2, 0.0, 1.0, hi_open=True)
    check_range("adam_eps", adam_eps, 0.0, math.inf)
    if scalar_optimizer not in ("adamw", "lion"):
        raise ValueError(f"scalar_optimizer must be 'adamw' or 'lion', got {scalar_optimizer=!r}")
    matrix_tx = optax.chain(
        scale_by_dion3(
            fraction, mu, beta2, flavour=flavour, adjust_lr=adjust_lr,
            dimension_numbers=dimension_numbers, num_heads=num_heads, split_sizes=split_sizes,
            mu_dtype=mu_dtype, orthogonalizer=orthogonalizer, method=method,
            coefficients=coefficients, restarts=restarts, compute_dtype=compute_dtype,
            backend=backend, mesh=mesh, shard_axis=shard_axis, replica_axis=replica_axis,
            selection_scope=selection_scope, replica_selection=replica_selection, seed=seed,
            param_specs=param_specs),
        optax.add_decayed_weights(weight_decay, weight_decay_mask),
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
    return optax.partition({DION3_LABEL: matrix_tx, SCALAR_LABEL: scalar_tx}, param_labels)


def muon(learning_rate: optax.ScalarOrSchedule, mu: jax.typing.ArrayLike = 0.95,
         weight_decay: optax.ScalarOrSchedule = 0.01, weight_decay_mask: Any = None,
         **kwargs) -> optax.GradientTransformationExtraArgs:
    """Muon (momentum ``U = μU + G``, no Nesterov) through the Dion3 code path at ``f = 1``.

    Args:
      learning_rate: base learning rate or schedule.
      mu: momentum coefficient.
      weight_decay: decoupled weight decay of the matrices.
      weight_decay_mask: optional mask for it.
      **kwargs: any keyword-only argument of :func:`dion3` except ``flavour``.

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    References:
      Jordan et al., `Muon <https://kellerjordan.github.io/posts/muon/>`_, 2024.
    """
    return dion3(learning_rate, 1.0, mu, 0.95, weight_decay, weight_decay_mask, flavour="muon",
                 **kwargs)


def normuon(learning_rate: optax.ScalarOrSchedule, mu: jax.typing.ArrayLike = 0.95,
            beta2: jax.typing.ArrayLike = 0.95, weight_decay: optax.ScalarOrSchedule = 0.01,
            weight_decay_mask: Any = None, **kwargs) -> optax.GradientTransformationExtraArgs:
    """NorMuon (row-normalised Muon) through the Dion3 code path at ``f = 1``.

    Args:
      learning_rate: base learning rate or schedule.
      mu: momentum coefficient.
      beta2: second-moment EMA coefficient.
      weight_decay: decoupled weight decay of the matrices.
      weight_decay_mask: optional mask for it.
      **kwargs: any keyword-only argument of :func:`dion3` except ``flavour``.

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    References:
      Li et al., `NorMuon <https://arxiv.org/abs/2510.05491>`_, 2025.
    """
    return dion3(learning_rate, 1.0, mu, beta2, weight_decay, weight_decay_mask,
                 flavour="normuon", **kwargs)


def _forward_signature(alias, drop: tuple[str, ...]):
    """Gives ``alias`` (which forwards ``**kwargs`` to :func:`dion3`) an explicit signature, so
    ``inspect.signature`` — and hence ``optax.inject_hyperparams`` — sees every argument."""
    own = inspect.signature(alias).parameters
    params = [p for name, p in own.items() if p.kind is not p.VAR_KEYWORD]
    params += [p for name, p in inspect.signature(dion3).parameters.items()
               if p.kind is p.KEYWORD_ONLY and name not in drop and name not in own]
    alias.__signature__ = inspect.Signature(params, return_annotation=inspect.Signature.empty)
    return alias


_forward_signature(muon, ("flavour",))
_forward_signature(normuon, ("flavour",))
