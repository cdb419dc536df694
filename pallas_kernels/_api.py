"""Implementation dispatch for the symmetric products.

``implementation`` names a backend:

- ``"xla"``: the plain jnp reference (:mod:`pallas_kernels._reference`); always available.
- ``"mosaic"``: the Pallas Mosaic GPU kernel (:mod:`pallas_kernels._mosaic`); Hopper (sm_90) only,
  float16/bfloat16 operands; with ``interpret=True`` it runs anywhere through GPU interpret mode.
- ``"triton"``: the Triton kernel called through jax-triton (:mod:`pallas_kernels._triton`); NVIDIA
  GPUs with ``jax_triton`` installed, float16/bfloat16 operands; no interpret mode.
- ``"auto"``: the fastest kernel measured on this kind of device for 16-bit operands when one
  call's ``batch · n² · k`` (the full product's multiply-adds) is at least ``AUTO_MIN_WORK``,
  else ``"xla"``.

A named implementation that cannot run raises ``ValueError``; there is no silent fallback.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Literal

import jax
import jax.numpy as jnp

from pallas_kernels._common import KERNEL_DTYPES
from pallas_kernels._reference import sym_matmul_reference, syrk_reference

Implementation = Literal["auto", "xla", "mosaic", "triton"]
_KNOWN = ("auto", "xla", "mosaic", "triton")

#: "auto" uses a kernel only for ``batch · n² · k >= AUTO_MIN_WORK`` (``k``: the contraction
#: length): below that the lower-triangle walk has too few tiles, or too short a main loop, to
#: beat XLA. One H200, 2026-11-29 (``benchmarks/bench_kernels.py``, docs/KERNELS.md): 4096³
#: sym_matmul (1.63–1.70×) and a batch of 32 1024×4096 syrk (1.32–1.50×, 1.4e11) won; syrk
#: 2048×8192 (3.4e10, 0.97–1.03×) and a batch of 32 1024² sym_matmul (3.4e10, 0.95–1.01×)
#: tied. Without the diagonal-tile pass (2026-12-01) the Mosaic sym_matmul also wins on smaller
#: products by device time (8·1024² 1.35×, 32·512² 1.63×). The line sits at 8·1024³ = 2³³, the
#: f = 1/4 step's down projections: with them on Mosaic the step's device time went 29.49 →
#: 29.31 ms (2026-12-02, one process, docs/BENCHMARKS.md; an earlier single comparison had the
#: step 1% slower). Smaller products stay on XLA, where a kernel's compile time and launch would
#: outweigh microseconds.
AUTO_MIN_WORK = 8 * 1024 ** 3

#: "auto" preference per GPU generation (first available wins), from benchmarks/bench_kernels.py.
_AUTO_PREFERENCE = {
    "hopper": ("mosaic", "triton"),
    "other": ("triton",),
}


def _default_device():
    return jax.devices()[0]


def _compute_capability(device) -> str | None:
    if device.platform != "gpu":
        return None
    return getattr(device, "compute_capability", None)


def _is_hopper(device) -> bool:
    cc = _compute_capability(device)
    return cc is not None and cc.split(".")[0] == "9"


@functools.cache
def _has_jax_triton() -> bool:
    return (importlib.util.find_spec("jax_triton") is not None
            and importlib.util.find_spec("triton") is not None)


def available_implementations() -> tuple[str, ...]:
    """Implementations that can run (without interpret mode) on the default backend.

    Returns:
      A tuple that always starts with ``"xla"``, followed by ``"mosaic"`` on Hopper GPUs and
      ``"triton"`` on NVIDIA GPUs where ``jax_triton`` is importable.
    """
    device = _default_device()
    names = ["xla"]
    if _is_hopper(device):
        names.append("mosaic")
    if device.platform == "gpu" and "NVIDIA" in device.device_kind.upper() and _has_jax_triton():
        names.append("triton")
    return tuple(names)


def _work(shape) -> int:
    """``batch · n² · k`` for a left operand of shape ``(..., n, k)``."""
    batch = 1
    for d in shape[:-2]:
        batch *= d
    return batch * shape[-2] * shape[-2] * shape[-1]


def _resolve(implementation: str, *, dtypes, size: int, interpret) -> str:
    """Returns the concrete backend for one call (``size``: :func:`_work`), or raises."""
    if implementation not in _KNOWN:
        raise ValueError(f"implementation must be one of {_KNOWN}, got {implementation=!r}")
    kernel_dtypes = all(jnp.dtype(d) in KERNEL_DTYPES for d in dtypes)
    if implementation == "xla":
        return "xla"
    if implementation == "auto":
        if not kernel_dtypes or size < AUTO_MIN_WORK:
            return "xla"
        available = available_implementations()
        generation = "hopper" if _is_hopper(_default_device()) else "other"
        for name in _AUTO_PREFERENCE[generation]:
            if name in available:
                return name
        return "xla"
    if not kernel_dtypes:
        raise ValueError(f"{implementation=!r} takes float16/bfloat16 operands, got dtypes "
                         f"{[str(jnp.dtype(d)) for d in dtypes]}; use implementation='xla'")
    if implementation == "triton" and interpret:
        raise ValueError("implementation='triton' has no interpret mode (jax-triton kernels run "
                         "only on NVIDIA GPUs); use 'mosaic' or 'xla'")
    if implementation == "mosaic" and interpret:
        return "mosaic"
    if implementation not in available_implementations():
        raise ValueError(
            f"{implementation=!r} cannot run on the default device "
            f"({_default_device().device_kind!r}); available: {available_implementations()}"
            + (" (mosaic needs a Hopper GPU, sm_90)" if implementation == "mosaic" else
               " (triton needs an NVIDIA GPU and the jax-triton package)"))
    return implementation


#: Row and contraction multiples the kernels pad their operands to (the default tile and panel
#: depth of ``MosaicConfig`` and ``TritonConfig``): operands already aligned skip the padding copy.
TILE_MULTIPLES = (128, 64)


def padding_multiples(shape, dtype, implementation: Implementation = "auto"
                      ) -> tuple[int, int] | None:
    """The ``(rows, contraction)`` multiples a kernel would pad ``syrk`` of ``shape`` to.

    A caller that runs many products on one operand (Gram Newton-Schulz) can zero-pad it once to
    these multiples instead of every product padding its operands and slicing its result.

    Args:
      shape: ``(..., n, m)`` shape of the ``syrk`` operand.
      dtype: its dtype.
      implementation: as for :func:`syrk`.

    Returns:
      ``TILE_MULTIPLES`` when ``implementation`` resolves to a kernel for this operand, ``None``
      when it resolves to ``"xla"`` (which needs no padding).

    Raises:
      ValueError: as :func:`syrk` would for this implementation.
    """
    impl = _resolve(implementation, dtypes=(dtype,), size=_work(shape), interpret=False)
    return None if impl == "xla" else TILE_MULTIPLES


def syrk(x: jax.Array, *, transpose: bool = False, out_dtype=None,
         implementation: Implementation = "auto", interpret: bool = False) -> jax.Array:
    """Returns ``x · xᵀ`` (or ``xᵀ · x``) over the last two axes, batched over leading axes.

    Only the lower-triangular tiles are computed by the kernels; the upper ones are their mirror, so
    their result is exactly symmetric. ``"xla"`` computes every element, and its two halves may
    differ by a rounding (XLA's dot does not promise one summation order for both).

    Args:
      x: ``(..., n, m)``.
      transpose: return ``xᵀ · x``, ``(..., m, m)`` (BLAS ``syrk`` with ``trans='T'``): the Gram
        matrix of a tall ``x``'s columns, computed without a transposed copy of ``x``.
      out_dtype: output dtype (default ``x.dtype``); accumulation is float32.
      implementation: ``"auto"``, ``"xla"``, ``"mosaic"`` or ``"triton"`` (module docstring).
      interpret: run the Mosaic kernel through GPU interpret mode (CPU tests).

    Returns:
      The ``(..., n, n)`` Gram matrix (``(..., m, m)`` with ``transpose``).

    Raises:
      ValueError: for an unknown implementation, or a named one that cannot run here.
    """
    shape = (*x.shape[:-2], x.shape[-1], x.shape[-2]) if transpose else x.shape
    impl = _resolve(implementation, dtypes=(x.dtype,), size=_work(shape), interpret=interpret)
    if impl == "mosaic":
        from pallas_kernels._mosaic import syrk_mosaic

        return syrk_mosaic(x, transpose=transpose, out_dtype=out_dtype, interpret=interpret)
    if impl == "triton":
        from pallas_kernels._triton import syrk_triton

        return syrk_triton(x, transpose=transpose, out_dtype=out_dtype)
    return syrk_reference(x, transpose=transpose, out_dtype=out_dtype)


def sym_matmul(a: jax.Array, b: jax.Array, c: jax.Array | None = None, *, alpha: float = 1.0,
               beta: float = 0.0, out_dtype=None, implementation: Implementation = "auto",
               interpret: bool = False) -> jax.Array:
    """Returns ``alpha · a · b + beta · c`` where the result is known to be symmetric.

    Meant for products of commuting symmetric matrices (polynomials of one Gram matrix, as in Gram
    Newton-Schulz). The kernels compute the lower-triangular tiles only and mirror them exactly.
    Elements inside a diagonal tile are as computed: Triton's are exactly symmetric (the mirror
    is copied), Mosaic's and XLA's are symmetric up to one rounding. ``c`` must be symmetric
    (its lower triangle is read).

    Args:
      a: ``(..., n, k)``.
      b: ``(..., k, n)``.
      c: optional symmetric ``(..., n, n)`` addend.
      alpha: scale of the product (a Python float). The Mosaic and Triton kernels read
        ``alpha`` and ``beta`` at run time, so all products of one shape share one compiled
        kernel.
      beta: scale of ``c`` (a Python float).
      out_dtype: output dtype (default ``a.dtype``); accumulation is float32.
      implementation: ``"auto"``, ``"xla"``, ``"mosaic"`` or ``"triton"`` (module docstring).
      interpret: run the Mosaic kernel through GPU interpret mode (CPU tests).

    Returns:
      The ``(..., n, n)`` result.

    Raises:
      ValueError: for an unknown implementation, a named one that cannot run here, or mismatched
        shapes.
    """
    if a.shape[-1] != b.shape[-2] or a.shape[-2] != b.shape[-1]:
        raise ValueError(f"need a (..., n, k) and b (..., k, n), got {a.shape=} {b.shape=}")
    if c is not None and c.shape[-2:] != (a.shape[-2], a.shape[-2]):
        raise ValueError(f"c must be (..., n, n) with n={a.shape[-2]}, got {c.shape=}")
    impl = _resolve(implementation, dtypes=(a.dtype, b.dtype), size=_work(a.shape),
                    interpret=interpret)
    alpha, beta = float(alpha), float(beta)
    if impl == "mosaic":
        from pallas_kernels._mosaic import sym_matmul_mosaic

        return sym_matmul_mosaic(a, b, c, alpha=alpha, beta=beta, out_dtype=out_dtype,
                                 interpret=interpret)
    if impl == "triton":
        from pallas_kernels._triton import sym_matmul_triton

        return sym_matmul_triton(a, b, c, alpha=alpha, beta=beta, out_dtype=out_dtype)
    return sym_matmul_reference(a, b, c, alpha=alpha, beta=beta, out_dtype=out_dtype)
