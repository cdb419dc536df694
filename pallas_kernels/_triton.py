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
"""Symmetric matrix products in Triton language, called through jax-triton.

The portable GPU path (any recent NVIDIA GPU Triton supports). One program per lower-triangular
output tile ``(i, j)``, ``i >= j``, of every matrix in the batch, in the walk order of
:mod:`pallas_kernels._schedule`; a pipelined loop over the contraction axis (``num_stages``) feeds
``tl.dot`` with float32 accumulation:

- ``syrk``: ``out[i, j] = x[i] · x[j]ᵀ`` (``tl.trans`` of the ``x[j]`` panel; free on the tensor
  core); with ``transpose``, ``out[i, j] = x[:, i]ᵀ · x[:, j]`` (column panels, ``tl.trans`` of
  the left one);
- ``sym_matmul``: ``out[i, j] = α · a[i, :] · b[:, j] + β · c[i, j]``.

The epilogue stores the tile, then reads it back through transposed pointers and stores that at the
mirror position (a bit copy); on a diagonal tile the two masked stores write the lower triangle and
its mirror, so every element is written exactly once and the output is exactly symmetric. Operands
are padded to tile multiples by the wrapper so the kernel has no masks.

``triton`` and ``jax_triton`` are imported lazily: this module imports without them, and calling a
function without them raises ``ValueError``.

Reference: :func:`pallas_kernels._reference.syrk_reference` and
:func:`pallas_kernels._reference.sym_matmul_reference` (re-exported here) compute the same products
in plain jnp; ``tests/test_kernels_gpu.py`` compares this kernel against them on an NVIDIA GPU and
``tests/test_kernels_triton_interpret.py`` runs its logic in Triton's interpreter on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _schedule
from pallas_kernels._common import check_dtypes, pad_to, scales
from pallas_kernels._reference import sym_matmul_reference, syrk_reference

__all__ = ("TritonConfig", "sym_matmul_reference", "sym_matmul_triton", "syrk_reference",
           "syrk_triton")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TritonConfig:
    """Static tuning of the Triton kernel.

    Attributes:
      tile: side of the square output tile of one program.
      tile_k: depth of one operand panel along the contraction axis.
      num_warps: warps per program.
      num_stages: software-pipeline depth of the contraction loop.
    """

    tile: int = 128
    tile_k: int = 64
    num_warps: int = 8
    num_stages: int = 4

    @classmethod
    def get_default(cls) -> "TritonConfig":
        """The field defaults: 128×128 tiles, 64-deep panels, 8 warps, 4 stages."""
        return cls()


@functools.cache
def _kernel():
    """Builds the ``@triton.jit`` kernel on first use (keeps ``triton`` an optional import)."""
    try:
        import triton
        import triton.language as tl
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ValueError("implementation='jax_triton' needs the triton package") from e

    @triton.jit
    def symmetric_kernel(a_ptr, b_ptr, c_ptr, scale_ptr, out_ptr, N: tl.constexpr,
                         K: tl.constexpr, T: tl.constexpr, NUM_LOWER: tl.constexpr,
                         BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, A_TRANSPOSED: tl.constexpr,
                         B_TRANSPOSED: tl.constexpr, HAS_C: tl.constexpr,
                         HAS_SCALE: tl.constexpr):
        pid = tl.program_id(0)
        bi = pid // NUM_LOWER
        t = pid % NUM_LOWER
        # The folded lower-triangle walk of pallas_kernels._schedule.lower_tile_coords.
        q = t // (T + 1)
        s = t % (T + 1)
        long_len = T - q
        in_long = s < long_len
        ti = tl.where(in_long, T - 1 - q, q)
        tj = tl.where(in_long, s, s - long_len)

        offs_i = ti * BLOCK + tl.arange(0, BLOCK)
        offs_j = tj * BLOCK + tl.arange(0, BLOCK)
        offs_k = tl.arange(0, BLOCK_K)
        if A_TRANSPOSED:
            a_ptrs = a_ptr + bi.to(tl.int64) * (N * K) + offs_k[:, None] * N + offs_i[None, :]
        else:
            a_ptrs = a_ptr + bi.to(tl.int64) * (N * K) + offs_i[:, None] * K + offs_k[None, :]
        if B_TRANSPOSED:
            b_ptrs = b_ptr + bi.to(tl.int64) * (N * K) + offs_j[:, None] * K + offs_k[None, :]
        else:
            b_ptrs = b_ptr + bi.to(tl.int64) * (N * K) + offs_k[:, None] * N + offs_j[None, :]
        acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
        for _ in range(0, K // BLOCK_K):
            a = tl.load(a_ptrs)
            if A_TRANSPOSED:
                a = tl.trans(a)
                a_ptrs += BLOCK_K * N
            else:
                a_ptrs += BLOCK_K
            b = tl.load(b_ptrs)
            if B_TRANSPOSED:
                acc = tl.dot(a, tl.trans(b), acc)
                b_ptrs += BLOCK_K
            else:
                acc = tl.dot(a, b, acc)
                b_ptrs += BLOCK_K * N
        if HAS_SCALE:  # (α, β), float32, read at run time: one kernel for every scale
            acc = acc * tl.load(scale_ptr)
        out_base = out_ptr + bi.to(tl.int64) * (N * N)
        if HAS_C:
            c_ptrs = c_ptr + bi.to(tl.int64) * (N * N) + offs_i[:, None] * N + offs_j[None, :]
            acc += tl.load(scale_ptr + 1) * tl.load(c_ptrs).to(tl.float32)
        out = acc.to(out_ptr.dtype.element_ty)
        # The tile is stored once (on a diagonal tile: its lower triangle, diagonal included), then
        # the mirror is read back from global memory through transposed pointers and stored at
        # ``out[j, i]`` (on a diagonal tile: the strict upper triangle). Storing ``tl.trans(out)``
        # directly is not exact: Triton may rematerialize the epilogue's arithmetic in the
        # transposed layout with different FMA contraction, and on an H200 that broke symmetry
        # for ``sym_matmul``. The read-back copies bits, so every element is written exactly once
        # and the mirror equals the tile bit for bit.
        off_diag = ti != tj
        tl.store(out_base + offs_i[:, None] * N + offs_j[None, :], out,
                 mask=off_diag | (offs_i[:, None] >= offs_j[None, :]))
        tl.debug_barrier()  # The whole tile is in global memory before any thread reads it back.
        upper = offs_j[:, None] < offs_i[None, :]
        mirror = tl.load(out_base + offs_i[None, :] * N + offs_j[:, None], mask=off_diag | upper,
                         cache_modifier=".cg")  # From L2, where this block's stores landed.
        tl.store(out_base + offs_j[:, None] * N + offs_i[None, :], mirror, mask=off_diag | upper)

    return symmetric_kernel


def _jax_triton():
    try:
        import jax_triton
    except ImportError as e:
        raise ValueError("implementation='jax_triton' needs the jax-triton package (0.3.1 works "
                         "with triton 3.6): pip install 'jax-triton==0.3.1'") from e
    return jax_triton


def _launch(a, b, c, scale, *, out_dtype, config: TritonConfig, a_transposed: bool,
            b_transposed: bool, name: str):
    """Pads the operands to tile multiples and launches the kernel. ``scale``: ``(2,)`` float32
    ``(α, β)``, or None (``α = 1``, no ``c``)."""
    jt = _jax_triton()
    batch, n = a.shape[0], a.shape[2 if a_transposed else 1]
    tile, tile_k = config.tile, config.tile_k
    a_p = pad_to(a, (tile_k, tile) if a_transposed else (tile, tile_k))
    b_p = pad_to(b, (tile, tile_k) if b_transposed else (tile_k, tile))
    (n_p, k_p) = a_p.shape[:0:-1] if a_transposed else a_p.shape[1:]
    has_c = c is not None
    c_p = pad_to(c, (tile, tile)) if has_c else a_p  # A dummy pointer when there is no c.
    tiles_per_side = n_p // tile
    num_lower = _schedule.num_lower_tiles(tiles_per_side)
    out = jt.triton_call(
        a_p, b_p, c_p, a_p if scale is None else scale,  # (a dummy pointer without scales)
        kernel=_kernel(),
        out_shape=jax.ShapeDtypeStruct((batch, n_p, n_p), out_dtype),
        grid=(batch * num_lower,),
        name=name,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        N=n_p, K=k_p, T=tiles_per_side, NUM_LOWER=num_lower, BLOCK=tile, BLOCK_K=tile_k,
        A_TRANSPOSED=a_transposed, B_TRANSPOSED=b_transposed, HAS_C=has_c,
        HAS_SCALE=scale is not None,
    )
    return out[:, :n, :n]


@functools.partial(jax.jit, static_argnames=("transpose", "out_dtype", "config"))
def syrk_triton(x: jax.Array, *, transpose: bool = False, out_dtype=None,
                config: TritonConfig | None = None) -> jax.Array:
    """``x · xᵀ`` (or ``xᵀ · x``) over the last two axes with the Triton kernel.

    Args:
      x: ``(..., n, m)`` float16 or bfloat16.
      transpose: compute ``xᵀ · x``, ``(..., m, m)``, from column panels of ``x``.
      out_dtype: output dtype (default ``x.dtype``).
      config: tile sizes (default :meth:`TritonConfig.get_default`).

    Returns:
      ``(..., n, n)`` (``(..., m, m)`` with ``transpose``), accumulated in float32 and rounded
      once.
    """
    check_dtypes(x)
    config = config or TritonConfig.get_default()
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    *lead, rows, cols = x.shape
    x3 = x.reshape(-1, rows, cols)
    n = cols if transpose else rows
    out = _launch(x3, x3, None, None, out_dtype=out_dtype, config=config,
                  a_transposed=transpose, b_transposed=not transpose, name="syrk_triton")
    return out.reshape(*lead, n, n)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config"))
def sym_matmul_triton(a: jax.Array, b: jax.Array, c: jax.Array | None = None, *, alpha=1.0,
                      beta=0.0, out_dtype=None, config: TritonConfig | None = None
                      ) -> jax.Array:
    """``α · a · b + β · c`` for a symmetric result, with the Triton kernel.

    ``α`` and ``β`` reach the kernel at run time, as float32 scalars: every call of one shape and
    dtype runs one compiled kernel.

    Args:
      a: ``(..., n, k)`` float16 or bfloat16.
      b: ``(..., k, n)``, same dtype.
      c: optional symmetric ``(..., n, n)`` (its lower tiles are read; read whenever given).
      alpha: scale of the product (a float or a float32 scalar array; may be traced).
      beta: scale of ``c`` (likewise).
      out_dtype: output dtype (default ``a.dtype``).
      config: tile sizes (default :meth:`TritonConfig.get_default`).

    Returns:
      ``(..., n, n)``, accumulated in float32 and rounded once; exactly symmetric.
    """
    check_dtypes(a, b)
    config = config or TritonConfig.get_default()
    out_dtype = jnp.dtype(a.dtype if out_dtype is None else out_dtype)
    *lead, n, k = a.shape
    a3 = a.reshape(-1, n, k)
    b3 = jnp.broadcast_to(b, (*lead, k, n)).reshape(-1, k, n)
    c3 = None if c is None else jnp.broadcast_to(c, (*lead, n, n)).reshape(-1, n, n)
    out = _launch(a3, b3, c3, scales(alpha, beta), out_dtype=out_dtype, config=config,
                  a_transposed=False, b_transposed=False, name="sym_matmul_triton")
    return out.reshape(*lead, n, n)
