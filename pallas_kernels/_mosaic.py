"""Symmetric matrix products on Hopper with Pallas Mosaic GPU (``plgpu.kernel``).

One kernel serves both products. Each CTA is persistent (one per SM) and walks the lower-triangular
output tiles ``(i, j)``, ``i >= j``, of every matrix in the batch (:mod:`pallas_kernels._schedule`).
A memory warpgroup streams ``(tile, tile_k)`` panels of the operands into shared memory with TMA;
two compute warpgroups each own half of the tile's rows and accumulate in float32 with ``wgmma``:

- ``syrk``: ``out[i, j] = x[i] · x[j]ᵀ``; the ``x[j]`` panel is fed to ``wgmma`` through
  a transposed shared-memory view (the tensor core transposes 16-bit shared-memory operands for
  free).
- ``sym_matmul``: ``out[i, j] = α · a[i, :] · b[:, j] + β · c[i, j]``.

The epilogue rounds the tile once to the output dtype, stores it to ``out[i, j]`` and, off the
diagonal, stores its transpose (a register layout cast to ``WGMMA_TRANSPOSED`` and a transposed
shared-memory view) to ``out[j, i]``. Diagonal tiles are written exactly once. Operands are padded
to tile multiples by the wrapper and the result is sliced back, so any size works.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels import _schedule
from pallas_kernels._common import check_dtypes, pad_to
from pallas_kernels._reference import sym_matmul_reference, syrk_reference

__all__ = ("MosaicConfig", "sym_matmul_mosaic", "syrk_mosaic", "sym_matmul_reference",
           "syrk_reference")

#: SMs simulated by GPU interpret mode when no abstract device says otherwise.
_INTERPRET_NUM_SMS = 4


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MosaicConfig:
    """Static tuning of the Mosaic GPU kernel.

    Attributes:
      tile: side of the square output tile owned by one CTA (a multiple of 64·``num_compute_wgs``).
      tile_k: depth of one pipelined operand panel along the contraction axis.
      max_concurrent_steps: pipeline depth (panels in flight in shared memory).
      num_compute_wgs: compute warpgroups per CTA; each owns ``tile / num_compute_wgs`` rows.
      num_sms: persistent CTAs to launch; ``None`` takes the device's SM count.
    """

    tile: int = 128
    tile_k: int = 64
    max_concurrent_steps: int = 4
    num_compute_wgs: int = 2
    num_sms: int | None = None

    @classmethod
    def get_default(cls) -> "MosaicConfig":
        return cls()

    def __post_init__(self):
        if self.tile % (64 * self.num_compute_wgs):
            raise ValueError(f"{self.tile=} must be a multiple of 64 * {self.num_compute_wgs=}")
        if self.tile_k % 16 or self.tile_k <= 0:
            raise ValueError(f"{self.tile_k=} must be a positive multiple of 16")


def _num_sms(config: MosaicConfig, interpret: bool) -> int:
    if config.num_sms is not None:
        return config.num_sms
    abstract_device = jax.sharding.get_abstract_mesh().abstract_device
    if abstract_device is not None:
        return abstract_device.num_cores
    if interpret:
        return _INTERPRET_NUM_SMS
    return jax.devices()[0].core_count


def _smem_transforms(cols: int, dtype) -> tuple:
    swizzle = plgpu.find_swizzle(cols * jnp.dtype(dtype).itemsize * 8)
    swizzle_elems = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, swizzle_elems)), plgpu.SwizzleTransform(swizzle))


def _symmetric_kernel(a_gmem, b_gmem, c_gmem, out_gmem, *, config: MosaicConfig,
                      b_transposed: bool, alpha: float, beta: float, batch: int,
                      tiles_per_side: int):
    """Kernel body: the persistent walk over lower tiles, pipelined wgmma, mirrored epilogue.

    Args:
      a_gmem: ``(batch, n, k)`` left operand.
      b_gmem: ``(batch, n, k)`` when ``b_transposed`` (the product is ``a · bᵀ``), else
        ``(batch, k, n)``.
      c_gmem: ``(batch, n, n)`` addend in the output dtype, or ``None``.
      out_gmem: ``(batch, n, n)`` output.
      config: tile sizes.
      b_transposed: whether ``b`` is read row-panel-wise and transposed in shared memory.
      alpha: scale of the product (static).
      beta: scale of ``c`` (static).
      batch: number of matrices.
      tiles_per_side: ``n / tile``.
    """
    dtype = a_gmem.dtype
    out_dtype = out_gmem.dtype
    tile, tile_k = config.tile, config.tile_k
    wgs = config.num_compute_wgs
    wg_rows = tile // wgs
    k_iters = a_gmem.shape[-1] // tile_k
    in_transforms = _smem_transforms(tile_k, dtype)
    out_transforms = _smem_transforms(tile, out_dtype)
    if b_transposed:
        b_spec = plgpu.BlockSpec((tile, tile_k), lambda k: (0, k), transforms=in_transforms,
                                 memory_space=plgpu.SMEM)
    else:
        b_spec = plgpu.BlockSpec((tile_k, tile), lambda k: (k, 0),
                                 transforms=_smem_transforms(tile, dtype), memory_space=plgpu.SMEM)
    a_spec = plgpu.BlockSpec((tile, tile_k), lambda k: (0, k), transforms=in_transforms,
                             memory_space=plgpu.SMEM)

    def get_pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_iters,),
            memory_registers=40,
            in_specs=[a_spec, b_spec],
            wg_axis="wg",
            num_compute_wgs=wgs,
            max_concurrent_steps=config.max_concurrent_steps,
            compute_context=compute_context,
        )

    ignore = lambda *_, **__: None
    a_block = a_gmem.at[0, pl.ds(0, tile), :]
    b_block = b_gmem.at[0, pl.ds(0, tile), :] if b_transposed else b_gmem.at[0, :, pl.ds(0, tile)]

    @functools.partial(
        pl.run_scoped,
        pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(a_block, b_block),
        out_smem=plgpu.SMEM((wgs, wg_rows, tile), out_dtype, transforms=out_transforms),
        out_t_smem=plgpu.SMEM((wgs, tile, wg_rows), out_dtype),
        c_barrier=None if c_gmem is None else plgpu.Barrier(num_barriers=wgs),
        collective_axes="wg",
    )
    def _scope(pipeline_allocs, out_smem, out_t_smem, c_barrier):
        wg = lax.axis_index("wg")
        num_lower = _schedule.num_lower_tiles(tiles_per_side)

        @plgpu.nd_loop((batch * num_lower,), collective_axes="sm")
        def _tile_loop(loop_info: plgpu.NDLoopInfo):
            (lin_idx,) = loop_info.index
            bi, ti, tj = _schedule.batched_lower_tile_coords(lin_idx, tiles_per_side)
            rows = pl.ds(ti * tile, tile)
            cols = pl.ds(tj * tile, tile)
            wg_rows_slice = pl.ds(wg * wg_rows, wg_rows)
            out_rows = pl.ds(ti * tile + wg * wg_rows, wg_rows)

            def compute_context(eval_pipeline):
                @functools.partial(pl.run_scoped,
                                   acc_ref=plgpu.ACC((wg_rows, tile), jnp.float32))
                def _acc_scope(acc_ref):
                    eval_pipeline(acc_ref)
                    acc = acc_ref[...]
                    if alpha != 1.0:
                        acc = acc * alpha
                    # The previous tile's stores must have finished reading shared memory.
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    if c_gmem is not None and beta != 0.0:
                        plgpu.copy_gmem_to_smem(c_gmem.at[bi, out_rows, cols], out_smem.at[wg],
                                                c_barrier.at[wg])
                        plgpu.barrier_wait(c_barrier.at[wg])
                        acc = acc + beta * out_smem[wg].astype(jnp.float32)
                    out = acc.astype(out_dtype)
                    out_smem[wg] = out
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[bi, out_rows, cols])

                    @pl.when(ti != tj)
                    def _mirror():
                        out_t = plgpu.layout_cast(out, plgpu.Layout.WGMMA_TRANSPOSED)
                        out_t_smem.at[wg].transpose((1, 0))[...] = out_t
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(out_t_smem.at[wg], out_gmem.at[bi, cols, out_rows])

            def mma_body(_, a_smem, b_smem, acc_ref):
                b_op = b_smem.transpose((1, 0)) if b_transposed else b_smem
                plgpu.wgmma(acc_ref, a_smem.at[wg_rows_slice], b_op)
                plgpu.wgmma_wait(0)
                return acc_ref

            b_panel = b_gmem.at[bi, cols, :] if b_transposed else b_gmem.at[bi, :, cols]
            get_pipeline(mma_body, compute_context)(
                a_gmem.at[bi, rows, :], b_panel, allocations=pipeline_allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _interpret_params(interpret):
    """``interpret`` as ``plgpu.kernel`` takes it: ``None``, or GPU interpret-mode parameters."""
    if interpret is False or interpret is None:
        return None
    if interpret is True:
        # Private import: GPU interpret mode has no public path in jax 0.11.2.
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

        return InterpretGPUParams()
    return interpret  # Already an ``InterpretGPUParams`` (e.g. with ``detect_races=True``).


def _launch(a, b, c, *, out_dtype, config, b_transposed, alpha, beta, interpret):
    """Pads, launches the kernel on ``(batch, n, ·)`` operands and slices the result back."""
    batch, n = a.shape[0], a.shape[1]
    tile, tile_k = config.tile, config.tile_k
    a_p = pad_to(a, (tile, tile_k))
    b_p = pad_to(b, (tile, tile_k) if b_transposed else (tile_k, tile))
    n_p = a_p.shape[1]
    operands = [a_p, b_p]
    if c is not None and beta != 0.0:
        operands.append(pad_to(c.astype(out_dtype), (tile, tile)))
    else:
        c = None
    body = functools.partial(
        _symmetric_kernel, config=config, b_transposed=b_transposed, alpha=alpha, beta=beta,
        batch=batch, tiles_per_side=n_p // tile)
    if c is None:
        body_fn = lambda a_ref, b_ref, o_ref: body(a_ref, b_ref, None, o_ref)
    else:
        body_fn = body
    kernel = plgpu.kernel(
        body_fn,
        out_type=jax.ShapeDtypeStruct((batch, n_p, n_p), out_dtype),
        grid=(_num_sms(config, interpret),),
        grid_names=("sm",),
        num_threads=config.num_compute_wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=_interpret_params(interpret),
        kernel_name="sym_matmul_mosaic" if not b_transposed else "syrk_mosaic",
    )
    out = kernel(*operands)
    if not b_transposed:
        out = symmetrize_diagonal_tiles(out, tile)
    return out[:, :n, :n]


def symmetrize_diagonal_tiles(out: jax.Array, tile: int) -> jax.Array:
    """Makes the diagonal ``tile × tile`` blocks of ``(batch, n, n)`` exactly symmetric.

    Off-diagonal tiles are mirrored by the kernel, so they are symmetric by construction. A diagonal
    tile of ``a · b`` is not when ``a`` and ``b`` commute only up to rounding; its lower triangle is
    kept and mirrored. The cost is one gather and scatter of ``n · tile`` elements.
    """
    batch, n, _ = out.shape
    t = n // tile
    blocks = out.reshape(batch, t, tile, t, tile)
    idx = jnp.arange(t)
    diag = blocks[:, idx, :, idx, :]  # (t, batch, tile, tile)
    lower = jnp.tri(tile, dtype=bool)
    diag = jnp.where(lower, diag, jnp.swapaxes(diag, -1, -2))
    return blocks.at[:, idx, :, idx, :].set(diag).reshape(batch, n, n)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def syrk_mosaic(x: jax.Array, *, out_dtype=None, config: MosaicConfig | None = None,
                interpret: bool = False) -> jax.Array:
    """``x · xᵀ`` over the last two axes with the Mosaic GPU kernel.

    Args:
      x: ``(..., n, m)`` float16 or bfloat16.
      out_dtype: output dtype (default ``x.dtype``).
      config: tile sizes (default :meth:`MosaicConfig.get_default`).
      interpret: run through GPU interpret mode (CPU; slow; for tests); ``True`` or an
        ``InterpretGPUParams`` (e.g. with ``detect_races=True``).

    Returns:
      ``(..., n, n)``, accumulated in float32 and rounded once.
    """
    check_dtypes(x)
    config = config or MosaicConfig.get_default()
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    *lead, n, m = x.shape
    x3 = x.reshape(-1, n, m)
    out = _launch(x3, x3, None, out_dtype=out_dtype, config=config, b_transposed=True,
                  alpha=1.0, beta=0.0, interpret=interpret)
    return out.reshape(*lead, n, n)


@functools.partial(jax.jit,
                   static_argnames=("alpha", "beta", "out_dtype", "config", "interpret"))
def sym_matmul_mosaic(a: jax.Array, b: jax.Array, c: jax.Array | None = None, *, alpha: float = 1.0,
                      beta: float = 0.0, out_dtype=None, config: MosaicConfig | None = None,
                      interpret: bool = False) -> jax.Array:
    """``α · a · b + β · c`` for a symmetric result, with the Mosaic GPU kernel.

    Only the lower tiles are computed; the upper ones are their mirror. ``c`` must be symmetric (its
    lower tiles are read).

    Args:
      a: ``(..., n, k)`` float16 or bfloat16.
      b: ``(..., k, n)``, same dtype.
      c: optional symmetric ``(..., n, n)``.
      alpha: scale of the product (static).
      beta: scale of ``c`` (static).
      out_dtype: output dtype (default ``a.dtype``).
      config: tile sizes (default :meth:`MosaicConfig.get_default`).
      interpret: run through GPU interpret mode (CPU; slow; for tests); ``True`` or an
        ``InterpretGPUParams`` (e.g. with ``detect_races=True``).

    Returns:
      ``(..., n, n)``, accumulated in float32 and rounded once.
    """
    check_dtypes(a, b)
    config = config or MosaicConfig.get_default()
    out_dtype = jnp.dtype(a.dtype if out_dtype is None else out_dtype)
    *lead, n, k = a.shape
    a3 = a.reshape(-1, n, k)
    b3 = jnp.broadcast_to(b, (*lead, k, n)).reshape(-1, k, n)
    c3 = None if c is None else jnp.broadcast_to(c, (*lead, n, n)).reshape(-1, n, n)
    out = _launch(a3, b3, c3, out_dtype=out_dtype, config=config, b_transposed=False,
                  alpha=float(alpha), beta=float(beta), interpret=interpret)
    return out.reshape(*lead, n, n)
