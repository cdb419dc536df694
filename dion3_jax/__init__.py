"""dion3_jax: the Dion3 optimizer for JAX and optax.

Dion3 orthogonalizes only the ``k = ceil(f·n)`` rows of the momentum with the largest ℓ1 norm,
decays only those rows (error feedback), normalises them NorMuon-style and computes the polar
factor with Gram Newton-Schulz.

References:
  Amsel, Zhang, Ahn, Naeimi, Feng, Chen, Dao, Langford, `Dion3: Full-Stack Orthogonal Updates
  <https://arxiv.org/abs/2608.11612>`_, 2026.
"""

from dion3_jax._alias import (
    dion3,
    muon,
    normuon,
    transfer_learning_rate,
)
from dion3_jax._coefficients import PRESETS as COEFFICIENT_PRESETS
from dion3_jax._coefficients import get_coefficients
from dion3_jax._config import momentum_for_fraction
from dion3_jax._distributed import MeshOptions
from dion3_jax._layout import DimensionNumbers
from dion3_jax._orthogonalizer import Orthogonalizer, make_orthogonalizer
from dion3_jax._polar import gram_newton_schulz, polar, standard_newton_schulz
from dion3_jax._replica_sync import synchronize_momentum
from dion3_jax._restarts import autotune_restarts, restart_growth
from dion3_jax._routing import (
    DEFAULT_HEAD_PATTERN,
    DEFAULT_SCALAR_PATTERN,
    DEFAULT_VECTOR_PATTERN,
    default_param_labels,
    routing_table,
)
from dion3_jax._rules import lr_scale
from dion3_jax._selection import num_selected
from dion3_jax._transform import ScaleByDion3State, fold_momentum_scale, scale_by_dion3

__version__ = "0.1.0"

__all__ = (
    "COEFFICIENT_PRESETS",
    "DEFAULT_HEAD_PATTERN",
    "DEFAULT_SCALAR_PATTERN",
    "DEFAULT_VECTOR_PATTERN",
    "DimensionNumbers",
    "MeshOptions",
    "Orthogonalizer",
    "ScaleByDion3State",
    "autotune_restarts",
    "default_param_labels",
    "dion3",
    "fold_momentum_scale",
    "get_coefficients",
    "gram_newton_schulz",
    "lr_scale",
    "make_orthogonalizer",
    "momentum_for_fraction",
    "muon",
    "normuon",
    "num_selected",
    "polar",
    "restart_growth",
    "routing_table",
    "scale_by_dion3",
    "standard_newton_schulz",
    "synchronize_momentum",
    "transfer_learning_rate",
)
