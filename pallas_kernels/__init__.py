"""Kernels of Dion3's step: symmetric matrix products for Gram Newton-Schulz, and the payload pass.

``syrk(x) = x xᵀ`` and ``sym_matmul(a, b, c) = α·a·b + β·c`` for products known to be symmetric.
``implementation`` picks the backend: ``"xla"`` (plain jnp, always available), ``"mosaic"`` (Pallas
Mosaic GPU, Hopper), ``"triton"`` (jax-triton) or ``"auto"``.

``stack_payloads`` writes fully selected matrices' normalised payloads into one stack and their
decayed momenta, in one pass (a Pallas kernel on NVIDIA GPUs, or XLA).
"""

from pallas_kernels._api import (TILE_MULTIPLES, available_implementations, padding_multiples,
                                 sym_matmul, syrk)
from pallas_kernels._payload import stack_payloads, stack_payloads_reference
from pallas_kernels._reference import sym_matmul_reference, syrk_reference

__all__ = (
    "TILE_MULTIPLES",
    "available_implementations",
    "padding_multiples",
    "stack_payloads",
    "stack_payloads_reference",
    "sym_matmul",
    "sym_matmul_reference",
    "syrk",
    "syrk_reference",
)
