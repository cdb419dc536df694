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
"""The validated, static configuration of :func:`dion3_jax.scale_by_dion3`.

Every argument is checked once, at construction, so that a bad value raises a ``ValueError`` (or
``TypeError`` for a wrong type) naming it before anything is traced. Values that may be traced
(``mu`` and ``beta2`` under ``optax.inject_hyperparams``) are range-checked only when concrete.
"""

from __future__ import annotations

import math
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dion3_jax import _layout, _numbers
from dion3_jax._distributed import MeshOptions, check_mesh_options
from dion3_jax._polar_operator import PolarOperator, as_polar_operator

Flavor = Literal["normuon", "muon"]
PassImplementation = Literal["auto", "xla", "mosaic", "pallas_triton"]
PASS_IMPLEMENTATIONS = ("auto", "xla", "mosaic", "pallas_triton")
AdjustLR = Literal["spectral_norm", "rms_norm"] | None
FLAVORS = ("normuon", "muon")
ADJUST_LR = ("spectral_norm", "rms_norm", None)


class Dion3Config(NamedTuple):
    """Everything the step depends on besides the arrays (see :func:`scale_by_dion3`).

    The traced step does not read it: :func:`dion3_jax._plan.build_plan` resolves the options it
    consults into the plan, and ``mu`` and ``beta2`` reach it as ``_step.Coefficients``."""

    fraction: float
    mu: Any
    beta2: Any
    flavor: Flavor
    adjust_lr: AdjustLR
    dimension_numbers: Any
    num_heads: Any
    split_sizes: Any
    mu_dtype: Any
    orthogonalizer: PolarOperator
    mesh_options: MeshOptions
    pass_implementation: PassImplementation = "auto"


def is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def check_fraction(fraction) -> float:
    """Validates the static selected fraction and returns it as a Python float."""
    if isinstance(fraction, jax.Array):  # a tracer, or optax.inject_hyperparams's array at init
        raise ValueError(
            f"fraction is static: it fixes array shapes, so it cannot be traced or injected, got "
            f"{fraction=!r}. With optax.inject_hyperparams pass static_args=('fraction',), or "
            "give it as a fractions.Fraction (e.g. Fraction(1, 8)), which optax does not inject")
    if not _numbers.is_scalar_number(fraction):
        raise TypeError(f"fraction must be a Python or NumPy int or float or a fractions.Fraction, "
                        f"got {fraction=!r}")
    f = float(fraction)
    if not 0.0 < f <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction=!r}")
    return f


def check_range(name: str, value, lo: float, hi: float, hi_open: bool = False,
                schedule: bool = False) -> None:
    """Raises when a concrete ``value`` is outside ``[lo, hi]`` (or ``[lo, hi)``).

    Tracers pass, and callables where ``schedule`` (an optax schedule of the step count);
    elsewhere a callable raises a ``ValueError`` naming ``name`` and the value. ``None``,
    strings, bools and other non-numbers raise a ``TypeError`` naming ``name``; NaN and
    out-of-range values a ``ValueError``. Python and NumPy scalars (and 0-d arrays) are numbers.
    """
    if is_tracer(value) or (schedule and callable(value)):
        return
    if callable(value):
        raise ValueError(f"{name} must be a number, not a schedule or other callable (only the "
                         f"learning rates and weight decays take schedules), got {name}={value!r}")
    if value is None or isinstance(value, (str, bytes, bool, np.bool_)):
        raise TypeError(f"{name} must be a number, got {name}={value!r}")
    try:
        v = float(value)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name} must be a number, got {name}={value!r}") from e
    ok = lo <= v < hi if hi_open else lo <= v <= hi
    if not ok or math.isnan(v):
        bracket = ")" if hi_open else "]"
        raise ValueError(f"{name} must be in [{lo}, {hi}{bracket}, got {name}={value!r}")


def _check_mu_dtype(mu_dtype):
    if mu_dtype is None:
        return None
    try:
        dtype = jnp.dtype(mu_dtype)
    except TypeError as e:
        raise ValueError(f"mu_dtype must be a dtype or None, got {mu_dtype=!r}") from e
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"mu_dtype must be a floating dtype, got {mu_dtype=!r}")
    return dtype


def _check_layout_options(dimension_numbers, num_heads, split_sizes) -> None:
    if isinstance(num_heads, jax.Array):  # optax.inject_hyperparams injects a given int
        raise ValueError(
            f"num_heads is static: it fixes array shapes, so it cannot be traced or injected, "
            f"got {num_heads=!r}. With optax.inject_hyperparams pass static_args=('num_heads',)")
    if (dimension_numbers is not None and not callable(dimension_numbers)
            and _layout.is_single_value(dimension_numbers)
            and not hasattr(dimension_numbers, "reduction_axis")):
        raise ValueError("dimension_numbers must be a DimensionNumbers, a tree of them or a "
                         f"callable, got {dimension_numbers=!r}")
    if not callable(num_heads) and _layout.is_single_value(num_heads):
        _layout.check_num_heads(num_heads)
    if not callable(split_sizes) and _layout.is_single_value(split_sizes):
        _layout.check_split_sizes(split_sizes)
        if split_sizes is not None and isinstance(num_heads, int) and num_heads > 1:
            raise ValueError(f"num_heads and split_sizes cannot be combined, got {num_heads=} "
                             f"and {split_sizes=}")


def momentum_for_fraction(fraction: float, mu_full: float = 0.95) -> float:
    """The error-feedback decay for fraction ``f`` that keeps a row's memory: ``μ₁^(1/f)``.

    A row's momentum only decays when the row is selected, about every ``1/f`` steps, so at
    ``μ = μ₁`` it remembers about ``1/(f·(1−μ₁))`` steps instead of ``1/(1−μ₁)``. Decaying by
    ``μ₁^(1/f)`` per selection matches the full-rank memory; at f = 1/4 it trained clearly
    better than a constant μ = 0.95 (docs/QUALITY.md, docs/TRAINING.md).

    Args:
      fraction: the selected fraction ``f`` in ``(0, 1]``.
      mu_full: the momentum at ``f = 1`` (Muon's / NorMuon's).

    Returns:
      ``mu_full ** (1 / fraction)``.

    Examples:
      >>> from dion3_jax import momentum_for_fraction
      >>> round(momentum_for_fraction(0.25), 4)
      0.8145
    """
    f = check_fraction(fraction)
    check_range("mu_full", mu_full, 0.0, 1.0)
    return float(mu_full) ** (1.0 / f)


def make_config(fraction, mu, beta2, flavor, adjust_lr, dimension_numbers, num_heads,
                split_sizes, mu_dtype, orthogonalizer, mesh_options,
                pass_implementation="auto") -> Dion3Config:
    """Validates the arguments of :func:`scale_by_dion3` and returns its static config."""
    fraction = check_fraction(fraction)
    if mu is None:
        mu = momentum_for_fraction(fraction)
    check_range("mu", mu, 0.0, 1.0)
    check_range("beta2", beta2, 0.0, 1.0, hi_open=True)
    if flavor not in FLAVORS:
        raise ValueError(f"flavor must be one of {FLAVORS}, got {flavor=!r}")
    if adjust_lr not in ADJUST_LR:
        raise ValueError(f"adjust_lr must be one of {ADJUST_LR}, got {adjust_lr=!r}")
    _check_layout_options(dimension_numbers, num_heads, split_sizes)
    if pass_implementation not in PASS_IMPLEMENTATIONS:
        raise ValueError(f"pass_implementation must be one of {PASS_IMPLEMENTATIONS}, got "
                         f"{pass_implementation=!r}")
    mesh_options = MeshOptions() if mesh_options is None else mesh_options
    check_mesh_options(mesh_options)
    return Dion3Config(fraction, mu, beta2, flavor, adjust_lr, dimension_numbers, num_heads,
                       split_sizes, _check_mu_dtype(mu_dtype), as_polar_operator(orthogonalizer),
                       mesh_options, pass_implementation)
