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
"""dion3_jax: the Dion3 optimizer for JAX and optax.

Dion3 orthogonalizes only the ``k = ceil(f·n)`` rows of the momentum with the largest ℓ1 norm,
decays only those rows (error feedback), normalizes them NorMuon-style and computes the polar
factor with Gram Newton-Schulz.

The package's names are the optimizer and what configures it. Two public submodules, loaded on
first use, hold the rest: :mod:`dion3_jax.newton_schulz` (the iterations behind :func:`polar`,
their coefficients and the restart autotune, also ``python -m dion3_jax.newton_schulz``) and
:mod:`dion3_jax.routing` (the name patterns of :func:`default_param_labels`).

References:
  Amsel, Zhang, Ahn, Naeimi, Feng, Chen, Dao, Langford, `Dion3: Full-Stack Orthogonal Updates
  <https://arxiv.org/abs/2608.11612>`_, 2026.
"""

import importlib as _importlib
import typing as _typing

from dion3_jax._alias import dion3, muon, normuon, transfer_learning_rate
from dion3_jax._config import momentum_for_fraction
from dion3_jax._distributed import MeshOptions
from dion3_jax._finite import apply_if_finite
from dion3_jax._layout import DimensionNumbers
from dion3_jax._orthogonalizer import Orthogonalizer, make_orthogonalizer
from dion3_jax._polar import polar
from dion3_jax._replica_sync import (stack_replica_momenta, synchronize_momentum,
                                      unstack_replica_momenta)
from dion3_jax._routing import default_param_labels, routing_table
from dion3_jax._transform import ScaleByDion3State, fold_momentum_scale, scale_by_dion3

if _typing.TYPE_CHECKING:
    from dion3_jax import newton_schulz, routing

# The one place the version is written: pyproject.toml reads it (a literal, read without importing).
__version__ = "0.1.0"

__all__ = (
    "DimensionNumbers",
    "MeshOptions",
    "Orthogonalizer",
    "ScaleByDion3State",
    "apply_if_finite",
    "default_param_labels",
    "dion3",
    "fold_momentum_scale",
    "make_orthogonalizer",
    "momentum_for_fraction",
    "muon",
    "normuon",
    "polar",
    "routing_table",
    "scale_by_dion3",
    "stack_replica_momenta",
    "synchronize_momentum",
    "transfer_learning_rate",
    "unstack_replica_momenta",
)

# The public submodules; ``import dion3_jax`` alone does not import them, so that ``python -m
# dion3_jax.newton_schulz`` runs its module once.
_SUBMODULES = ("newton_schulz", "routing")


def __getattr__(name: str):
    """``dion3_jax.newton_schulz`` and ``dion3_jax.routing``, imported on first access."""
    if name in _SUBMODULES:
        return _importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_SUBMODULES})
