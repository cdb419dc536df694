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
"""Kernels of Dion3's step: symmetric matrix products for Gram Newton-Schulz, and the payload pass.

``syrk(x) = x xᵀ`` and ``sym_matmul(a, b, c) = α·a·b + β·c`` for products known to be symmetric.
``implementation`` picks what runs: ``"xla"`` (plain jnp, always available), ``"mosaic"`` (Pallas
Mosaic GPU, Hopper), ``"jax_triton"`` (jax-triton) or ``"auto"``.

``accumulate_rows`` writes the summed momentum ``S = d ⊙ M + G`` with each row's ℓ1 norm and sum of
squares (the statistics pass); ``stack_payloads`` writes the selected rows of ``S``, normalized,
into one stack (the payload pass). Both take ``"xla"``, ``"mosaic"`` (Pallas Mosaic GPU, Hopper;
the payload pass for every row only), ``"pallas_triton"`` (Pallas' deprecated Triton lowering,
only when named) or ``"auto"``.
"""

from pallas_kernels._api import (TILE_MULTIPLES, available_implementations, padding_multiples,
                                 sym_matmul, syrk)
from pallas_kernels._payload import stack_payloads
from pallas_kernels._payload_reference import stack_payloads_reference
from pallas_kernels._row_stats import accumulate_rows, accumulate_rows_implementation
from pallas_kernels._row_stats_reference import accumulate_rows_reference, scaled_sum
from pallas_kernels._reference import sym_matmul_reference, syrk_reference

__all__ = (
    "TILE_MULTIPLES",
    "accumulate_rows",
    "accumulate_rows_implementation",
    "accumulate_rows_reference",
    "available_implementations",
    "padding_multiples",
    "scaled_sum",
    "stack_payloads",
    "stack_payloads_reference",
    "sym_matmul",
    "sym_matmul_reference",
    "syrk",
    "syrk_reference",
)
