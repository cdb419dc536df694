"""Implementation dispatch for the symmetric products."""

from __future__ import annotations

from typing import Literal

import jax

from pallas_kernels._reference import sym_matmul_reference, syrk_reference

Implementation = Literal["auto", "xla", "mosaic", "triton"]
_KNOWN = ("auto", "xla", "mosaic", "triton")


def available_implementations() -> tuple[str, ...]:
    """Implementations that can run on the default backend."""
    return ("xla",)


def _resolve(implementation: str) -> str:
    if implementation not in _KNOWN:
        raise ValueError(f"implementation must be one of {_KNOWN}, got {implementation=!r}")
    if implementation == "auto":
        return "xla"
    if implementation not in available_implementations():
        raise ValueError(
            f"{implementation=!r} is not available here; available: {available_implementations()}"
        )
    return implementation


def syrk(x: jax.Array, *, out_dtype=None, implementation: Implementation = "auto",
         interpret: bool = False) -> jax.Array:
    """``x @ xᵀ`` over the last two axes (see ``syrk_reference``)."""
    del interpret
    _resolve(implementation)
    return syrk_reference(x, out_dtype=out_dtype)


def sym_matmul(a, b, c=None, *, alpha=1.0, beta=0.0, out_dtype=None,
               implementation: Implementation = "auto", interpret: bool = False) -> jax.Array:
    """``alpha·a·b + beta·c`` for a symmetric result (see ``sym_matmul_reference``)."""
    del interpret
    _resolve(implementation)
    return sym_matmul_reference(a, b, c, alpha=alpha, beta=beta, out_dtype=out_dtype)
