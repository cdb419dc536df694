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

``MosaicConfig`` fields select variants; the field defaults are the plain kernel above, and
:meth:`MosaicConfig.get_default` (used when no config is given) is the fastest measured on an
H200: ``pair_tiles=True`` (each CTA computes two tiles that share their column panel, one 128×128
accumulator per compute warpgroup, :func:`_paired_body`), ``pair_select="index"`` and
``wgmma_in_flight=1`` (one step's wgmmas stay in flight, ``delay_release=1``).
``epi_double_buffer=True`` double-buffers the paired epilogue (slower on the H200: it leaves room for
only 3 pipeline stages; docs/KERNELS.md).
"""

from __future__ import annotations

import contextlib
import contextvars
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

__all__ = ("MosaicConfig", "SMEM_LIMIT", "smem_bytes", "sym_matmul_mosaic", "syrk_mosaic",
           "sym_matmul_reference", "syrk_reference")

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
      wgmma_in_flight: ``wgmma`` groups left in flight at the end of a pipeline step (0 waits
        for the step's products before the next step; 1 keeps one in flight, and the operand
        slots are released one step later through ``BlockSpec(delay_release=1)``).
      pair_tiles: each CTA computes two ``tile × tile`` output tiles that share their column
        panel (:func:`pallas_kernels._schedule.pair_tile_coords`), one per compute warpgroup, so
        a step loads three operand panels for two tiles (the CTA tile of jax's
        ``hopper_matmul_mgpu`` is likewise 128×256). Needs ``num_compute_wgs == 2``.
      pair_select: with ``pair_tiles``, how a compute warpgroup picks its row panel in the main
        loop: ``"when"`` issues ``wgmma`` under ``pl.when(wg == 0)`` / ``pl.when(wg != 0)`` on the
        pipeline's two row-panel buffers; ``"index"`` allocates both row-panel rings as one
        ``(2, stages, tile, tile_k)`` buffer and indexes it with ``[wg, k % stages]`` (no branch
        around ``wgmma``; relies on the pipeline's slot being ``step % max_concurrent_steps``).
      epi_cols: with ``pair_tiles``, width of the epilogue sub-tiles (64 rows × ``epi_cols``)
        staged in shared memory; 64 leaves room for 4 stages of 128×64 panels.
      epi_double_buffer: with ``pair_tiles``, two staging slots per warpgroup: a sub-tile's stores
        are one bulk-copy group, and the next sub-tile waits only for the group before last (not
        for all stores), while the next ``c`` sub-tile is loaded during the current one's stores
        (the first during the main loop). Doubles the staging memory (3 stages fit).
      diag_in_epilogue: with ``pair_tiles`` and 64-wide sub-tiles, ``sym_matmul``'s diagonal
        tiles are made exactly symmetric in the epilogue instead of by an XLA pass after the
        kernel: a diagonal tile stores its lower sub-tiles with their mirrors and skips its upper
        one; a sub-tile on the diagonal keeps its lower triangle and takes its upper one from
        its own transpose (read back through the staging buffer).
      b_rows: ``sym_matmul`` reads ``b`` by row panels and transposes them in shared memory, as
        ``syrk`` reads its second operand (exact: ``b`` is symmetric, so ``b[:, j] = b[j, :]ᵀ``),
        instead of by column panels.
    """

    tile: int = 128
    tile_k: int = 64
    max_concurrent_steps: int = 4
    num_compute_wgs: int = 2
    num_sms: int | None = None
    wgmma_in_flight: int = 0
    pair_tiles: bool = False
    pair_select: str = "when"
    epi_cols: int = 64
    epi_double_buffer: bool = False
    diag_in_epilogue: bool = False
    b_rows: bool = False

    @classmethod
    def get_default(cls, in_dtype=jnp.float16, out_dtype=jnp.float16) -> "MosaicConfig":
        """The fastest configuration measured on an H200 (``docs/BENCHMARKS.md``, "Kernels").

        Tile pairs with a stacked row-panel ring and one ``wgmma`` group in flight
        (``pair_tiles=True, pair_select="index", wgmma_in_flight=1``); the pipeline is as deep
        as shared memory allows for these dtypes (4 stages for 16-bit outputs, 3 for float32).
        The field defaults of the class are the plain one-tile-per-CTA kernel.
        """
        config = cls(pair_tiles=True, pair_select="index", wgmma_in_flight=1,
                     **_DEFAULT_OVERRIDES.get())
        while (smem_bytes(config, in_dtype, out_dtype) > SMEM_LIMIT
               and config.max_concurrent_steps > config.wgmma_in_flight + 1):
            config = dataclasses.replace(config,
                                         max_concurrent_steps=config.max_concurrent_steps - 1)
        return config

    def __post_init__(self):
        if self.tile % (64 * self.num_compute_wgs):
            raise ValueError(f"{self.tile=} must be a multiple of 64 * {self.num_compute_wgs=}")
        if self.tile_k % 16 or self.tile_k <= 0:
            raise ValueError(f"{self.tile_k=} must be a positive multiple of 16")
        if self.wgmma_in_flight not in (0, 1) or self.wgmma_in_flight >= self.max_concurrent_steps:
            raise ValueError(f"{self.wgmma_in_flight=} must be 0 or 1 and < max_concurrent_steps")
        if self.pair_tiles and self.num_compute_wgs != 2:
            raise ValueError("pair_tiles needs num_compute_wgs == 2")
        if self.pair_tiles and (self.epi_cols % 64 or self.tile % self.epi_cols):
            raise ValueError(f"{self.epi_cols=} must be a multiple of 64 dividing {self.tile=}")
        if self.epi_double_buffer and not self.pair_tiles:
            raise ValueError("epi_double_buffer needs pair_tiles=True")
        if self.diag_in_epilogue and not (self.pair_tiles and self.epi_cols == 64
                                          and not self.epi_double_buffer):
            raise ValueError("diag_in_epilogue needs pair_tiles=True, epi_cols=64 and "
                             "epi_double_buffer=False")
        if self.pair_select not in ("when", "index"):
            raise ValueError(f"{self.pair_select=} must be 'when' or 'index'")


_DEFAULT_OVERRIDES = contextvars.ContextVar("mosaic_default_overrides", default={})


@contextlib.contextmanager
def _default_overrides(**fields):
    """Private, for benchmarks: :meth:`MosaicConfig.get_default` called (at trace time) inside
    this context sets these fields too, so a whole step can be compared with another default."""
    token = _DEFAULT_OVERRIDES.set(dict(fields))
    try:
        yield
    finally:
        _DEFAULT_OVERRIDES.reset(token)


#: Shared memory a CTA may use on Hopper (227 KiB) less room for barriers and alignment.
SMEM_LIMIT = 227 * 1024 - 1024


def smem_bytes(config: MosaicConfig, in_dtype, out_dtype) -> int:
    """Shared memory of the kernel's buffers: the operand ring and the epilogue staging."""
    in_size, out_size = jnp.dtype(in_dtype).itemsize, jnp.dtype(out_dtype).itemsize
    panel = config.tile * config.tile_k * in_size
    if config.pair_tiles:
        slots = 2 if config.epi_double_buffer else 1
        return (config.max_concurrent_steps * 3 * panel
                + slots * 2 * 2 * 64 * config.epi_cols * out_size)
    return config.max_concurrent_steps * 2 * panel + 2 * config.tile * config.tile * out_size


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


def _first_panels(a_gmem, b_gmem, tile: int, b_transposed: bool):
    """Refs shaped like one ``a`` row panel and one ``b`` panel (for sizing the pipeline)."""
    a_block = a_gmem.at[0, pl.ds(0, tile), :]
    b_block = b_gmem.at[0, pl.ds(0, tile), :] if b_transposed else b_gmem.at[0, :, pl.ds(0, tile)]
    return a_block, b_block


def _pipeline(in_specs, blocks, *, k_iters: int, wgs: int, config: "MosaicConfig"):
    """``(get_pipeline, allocations)``: ``get_pipeline(body, compute_context)`` builds the
    warp-specialized pipeline over ``k_iters`` contraction steps of ``in_specs``, and
    ``allocations`` are its shared-memory buffers for operands shaped like ``blocks``, allocated
    once and reused by every work item."""
    def get_pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_iters,),
            memory_registers=40,
            in_specs=in_specs,
            wg_axis="wg",
            num_compute_wgs=wgs,
            max_concurrent_steps=config.max_concurrent_steps,
            compute_context=compute_context,
        )

    ignore = lambda *_, **__: None
    return get_pipeline, get_pipeline(ignore, ignore).get_allocations(*blocks)


def _store_mirror(out, out_t_buf, dst, *, commit_group: bool = True):
    """Stores the transpose of the rounded block ``out`` to ``dst`` through the plain staging
    buffer ``out_t_buf`` (a ``WGMMA_TRANSPOSED`` register layout and a transposed view)."""
    out_t = plgpu.layout_cast(out, plgpu.Layout.WGMMA_TRANSPOSED)
    out_t_buf.transpose((1, 0))[...] = out_t
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_t_buf, dst, commit_group=commit_group)


def _rounded(acc, out_smem, c_gmem, c_barrier, wg, bi, rows, cols, *, beta: float, out_dtype):
    """``acc + β·c[bi, rows, cols]`` (``c`` loaded through this warpgroup's staging buffer)
    rounded once to ``out_dtype``, after earlier stores have finished reading the buffers."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    if c_gmem is not None and beta != 0.0:
        plgpu.copy_gmem_to_smem(c_gmem.at[bi, rows, cols], out_smem.at[wg], c_barrier.at[wg])
        plgpu.barrier_wait(c_barrier.at[wg])
        acc = acc + beta * out_smem[wg].astype(jnp.float32)
    return acc.astype(out_dtype)


def _store_tile(acc, out_gmem, out_smem, out_t_smem, c_gmem, c_barrier, wg, bi, rows, cols,
                off_diagonal, *, beta: float, out_dtype):
    """Epilogue of one float32 block of a warpgroup: ``+ β·C`` (if any), one rounding, a TMA store
    to ``out[bi, rows, cols]`` and, when ``off_diagonal``, its transpose to ``out[bi, cols, rows]``
    (diagonal tiles are written exactly once)."""
    out = _rounded(acc, out_smem, c_gmem, c_barrier, wg, bi, rows, cols, beta=beta,
                   out_dtype=out_dtype)
    out_smem[wg] = out
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[bi, rows, cols])

    @pl.when(off_diagonal)
    def _mirror():
        _store_mirror(out, out_t_smem.at[wg], out_gmem.at[bi, cols, rows])


def _store_symmetrized(acc, out_gmem, out_smem, out_t_smem, c_gmem, c_barrier, wg, bi, rows,
                       cols, *, beta: float, out_dtype):
    """Epilogue of a square sub-tile on the output's diagonal (``config.diag_in_epilogue``): the
    rounded block's lower triangle, diagonal included, and its transpose above, so the stored
    block is exactly symmetric. The transpose comes back to registers through the plain staging
    buffer (written through a transposed view, as for a mirror)."""
    out = _rounded(acc, out_smem, c_gmem, c_barrier, wg, bi, rows, cols, beta=beta,
                   out_dtype=out_dtype)
    t_buf = out_t_smem.at[wg]
    t_buf.transpose((1, 0))[...] = plgpu.layout_cast(out, plgpu.Layout.WGMMA_TRANSPOSED)
    plgpu.commit_smem()  # Includes a warpgroup barrier: every thread's part of the transpose.
    out_t = plgpu.load(t_buf, layout=plgpu.Layout.WGMMA)
    n = out.shape[0]
    row = plgpu.broadcasted_iota(jnp.int32, (n, n), 0, layout=plgpu.Layout.WGMMA)
    col = plgpu.broadcasted_iota(jnp.int32, (n, n), 1, layout=plgpu.Layout.WGMMA)
    out_smem[wg] = jnp.where(row >= col, out, out_t)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[bi, rows, cols])


def _store_double_buffered(sub_tile, subs, out_gmem, out_smem, out_t_smem, c_gmem, c_barrier,
                           wg, bi, off_diagonal, *, beta: float, out_dtype):
    """Epilogue of ``config.epi_double_buffer``: sub-tile ``i`` (rows, cols ``subs[i]``) goes
    through staging slot ``i % 2`` of this warpgroup (buffers ``2·wg + slot``). Its stores (the
    tile and, off the diagonal, the mirror) form one bulk-copy group, so reusing a slot waits only
    for the group before last (``wait_smem_to_gmem(1)``). With ``c``, sub-tile ``i + 1``'s ``c``
    is loaded into the other slot while sub-tile ``i``'s stores run (sub-tile 0's was loaded during
    the main loop), and each load has its own barrier."""
    has_c = c_gmem is not None and beta != 0.0
    for i, (rows, cols) in enumerate(subs):
        buf = wg * 2 + i % 2
        acc = sub_tile(i)
        if has_c:
            plgpu.barrier_wait(c_barrier.at[buf])
            acc = acc + beta * out_smem[buf].astype(jnp.float32)
        else:
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # This slot's last stores are done.
        out = acc.astype(out_dtype)
        out_smem[buf] = out
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem.at[buf], out_gmem.at[bi, rows, cols], commit_group=False)

        @pl.when(off_diagonal)
        def _mirror():
            _store_mirror(out, out_t_smem.at[buf], out_gmem.at[bi, cols, rows],
                          commit_group=False)

        plgpu.commit_smem_to_gmem_group()
        if has_c and i + 1 < len(subs):
            nxt = wg * 2 + (i + 1) % 2
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # The other slot's stores are done.
            plgpu.copy_gmem_to_smem(c_gmem.at[bi, subs[i + 1][0], subs[i + 1][1]],
                                    out_smem.at[nxt], c_barrier.at[nxt])


def _symmetric_kernel(a_gmem, b_gmem, c_gmem, out_gmem, *, config: MosaicConfig,
                      b_transposed: bool, diagonal_exact: bool, alpha: float, beta: float,
                      batch: int, tiles_per_side: int):
    """Kernel body: the persistent walk over lower tiles, pipelined wgmma, mirrored epilogue.

    Args:
      a_gmem: ``(batch, n, k)`` left operand.
      b_gmem: ``(batch, n, k)`` when ``b_transposed`` (the product is ``a · bᵀ``), else
        ``(batch, k, n)``.
      c_gmem: ``(batch, n, n)`` addend in the output dtype, or ``None``.
      out_gmem: ``(batch, n, n)`` output.
      config: tile sizes.
      b_transposed: whether ``b`` is read row-panel-wise and transposed in shared memory.
      diagonal_exact: whether diagonal tiles come out exactly symmetric by themselves (``syrk``:
        ``x[i] · x[i]ᵀ``), so that ``config.diag_in_epilogue`` leaves them alone.
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
    # ``delay_release`` only when asked, so the default specs stay exactly as they were.
    extra = {"delay_release": config.wgmma_in_flight} if config.wgmma_in_flight else {}
    if b_transposed:
        b_spec = plgpu.BlockSpec((tile, tile_k), lambda k: (0, k), transforms=in_transforms,
                                 memory_space=plgpu.SMEM, **extra)
    else:
        b_spec = plgpu.BlockSpec((tile_k, tile), lambda k: (k, 0),
                                 transforms=_smem_transforms(tile, dtype), memory_space=plgpu.SMEM,
                                 **extra)
    a_spec = plgpu.BlockSpec((tile, tile_k), lambda k: (0, k), transforms=in_transforms,
                             memory_space=plgpu.SMEM, **extra)
    if config.pair_tiles:
        return _paired_body(a_gmem, b_gmem, c_gmem, out_gmem, a_spec=a_spec, b_spec=b_spec,
                            config=config, b_transposed=b_transposed,
                            diagonal_exact=diagonal_exact, alpha=alpha, beta=beta,
                            batch=batch, tiles_per_side=tiles_per_side)

    a_block, b_block = _first_panels(a_gmem, b_gmem, tile, b_transposed)
    get_pipeline, allocations = _pipeline(
        [a_spec, b_spec], [a_block, b_block], k_iters=k_iters, wgs=wgs, config=config)

    @functools.partial(
        pl.run_scoped,
        pipeline_allocs=allocations,
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
                    _store_tile(acc, out_gmem, out_smem, out_t_smem, c_gmem, c_barrier, wg, bi,
                                out_rows, cols, ti != tj, beta=beta, out_dtype=out_dtype)

            def mma_body(_, a_smem, b_smem, acc_ref):
                b_op = b_smem.transpose((1, 0)) if b_transposed else b_smem
                plgpu.wgmma(acc_ref, a_smem.at[wg_rows_slice], b_op)
                plgpu.wgmma_wait(config.wgmma_in_flight)
                return acc_ref

            b_panel = b_gmem.at[bi, cols, :] if b_transposed else b_gmem.at[bi, :, cols]
            get_pipeline(mma_body, compute_context)(
                a_gmem.at[bi, rows, :], b_panel, allocations=pipeline_allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _paired_body(a_gmem, b_gmem, c_gmem, out_gmem, *, a_spec, b_spec, config: MosaicConfig,
                 b_transposed: bool, diagonal_exact: bool, alpha: float, beta: float, batch: int,
                 tiles_per_side: int):
    """Kernel body for ``config.pair_tiles``: a CTA owns two tiles sharing their column panel.

    Work item ``(c, r1, r2)`` (:func:`pallas_kernels._schedule.pair_tile_coords`): warpgroup 0
    computes ``out[r1, c] = a[r1] · b[c]``, warpgroup 1 ``out[r2, c]``, each a full ``tile × tile``
    float32 accumulator (as in ``hopper_matmul_mgpu``). The pipeline streams three panels per step:
    ``a[r1]``, ``a[r2]``, ``b[c]``. Each warpgroup stores its tile and, off the diagonal, the mirror;
    an upper tile (``r < c``) is stored directly and its mirror is the lower one. When ``r2 == r1``
    (a single) warpgroup 1's result is dropped. The epilogue goes through ``64 × epi_cols``
    sub-tiles to keep the staging buffers small (``2 × 2 × 64 × epi_cols`` elements).
    """
    out_dtype = out_gmem.dtype
    tile, tile_k = config.tile, config.tile_k
    wgs = 2
    epi_rows, epi_cols = 64, config.epi_cols
    k_iters = a_gmem.shape[-1] // tile_k
    out_transforms = _smem_transforms(epi_cols, out_dtype)

    a_block, b_block = _first_panels(a_gmem, b_gmem, tile, b_transposed)
    get_pipeline, pipeline_allocs = _pipeline(
        [a_spec, a_spec, b_spec], [a_block, a_block, b_block], k_iters=k_iters, wgs=wgs,
        config=config)
    by_index = config.pair_select == "index"
    slots = 2 if config.epi_double_buffer else 1
    a_both = None
    if by_index:  # One buffer for both row-panel rings; the pipeline gets its two halves.
        a1_alloc, _, b_alloc = pipeline_allocs["flat_in_smem_refs"]
        a_both = plgpu.SMEM((2, *a1_alloc.shape), a1_alloc.dtype, transforms=a1_alloc.transforms)
        pipeline_allocs = dict(pipeline_allocs, flat_in_smem_refs=[b_alloc])

    @functools.partial(
        pl.run_scoped,
        pipeline_allocs=pipeline_allocs,
        a_both=a_both,
        out_smem=plgpu.SMEM((wgs * slots, epi_rows, epi_cols), out_dtype,
                            transforms=out_transforms),
        out_t_smem=plgpu.SMEM((wgs * slots, epi_cols, epi_rows), out_dtype),
        c_barrier=None if c_gmem is None else plgpu.Barrier(num_barriers=wgs * slots),
        collective_axes="wg",
    )
    def _scope(pipeline_allocs, a_both, out_smem, out_t_smem, c_barrier):
        wg = lax.axis_index("wg")
        num_items = _schedule.num_pair_items(tiles_per_side)
        if by_index:
            (b_ref,) = pipeline_allocs["flat_in_smem_refs"]
            pipeline_allocs = dict(pipeline_allocs,
                                   flat_in_smem_refs=[a_both.at[0], a_both.at[1], b_ref])

        @plgpu.nd_loop((batch * num_items,), collective_axes="sm")
        def _item_loop(loop_info: plgpu.NDLoopInfo):
            (lin_idx,) = loop_info.index
            bi, tc, tr1, tr2 = _schedule.batched_pair_tile_coords(lin_idx, tiles_per_side)
            tr = lax.select(wg == 0, tr1, tr2)  # This warpgroup's row panel.
            keep = jnp.logical_or(wg == 0, tr1 != tr2)  # A single's second copy is dropped.

            subs = [(pl.ds(tr * tile + ei * epi_rows, epi_rows),
                     pl.ds(tc * tile + ej * epi_cols, epi_cols))
                    for ei in range(tile // epi_rows) for ej in range(tile // epi_cols)]

            def compute_context(eval_pipeline):
                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile, tile), jnp.float32))
                def _acc_scope(acc_ref):
                    if config.epi_double_buffer and c_gmem is not None and beta != 0.0:
                        @pl.when(keep)
                        def _prefetch_c():  # The first c sub-tile loads during the main loop.
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                            plgpu.copy_gmem_to_smem(c_gmem.at[bi, subs[0][0], subs[0][1]],
                                                    out_smem.at[wg * 2], c_barrier.at[wg * 2])

                    eval_pipeline(acc_ref)
                    acc = acc_ref[...]
                    if alpha != 1.0:
                        acc = acc * alpha

                    def sub_tile(i):
                        ei, ej = divmod(i, tile // epi_cols)
                        return acc[ei * epi_rows:(ei + 1) * epi_rows,
                                   ej * epi_cols:(ej + 1) * epi_cols]

                    @pl.when(keep)
                    def _store():
                        if config.epi_double_buffer:
                            _store_double_buffered(sub_tile, subs, out_gmem, out_smem, out_t_smem,
                                                   c_gmem, c_barrier, wg, bi, tr != tc,
                                                   beta=beta, out_dtype=out_dtype)
                            return
                        store = functools.partial(
                            _store_tile, out_gmem=out_gmem, out_smem=out_smem,
                            out_t_smem=out_t_smem, c_gmem=c_gmem, c_barrier=c_barrier, wg=wg,
                            bi=bi, beta=beta, out_dtype=out_dtype)
                        in_kernel = config.diag_in_epilogue and not diagonal_exact
                        for i, (rows, cols) in enumerate(subs):
                            ei, ej = divmod(i, tile // epi_cols)
                            if not in_kernel:
                                store(sub_tile(i), rows=rows, cols=cols, off_diagonal=tr != tc)
                                continue
                            if ei > ej:  # On a diagonal tile, the mirror fills the sub-tile above.
                                store(sub_tile(i), rows=rows, cols=cols, off_diagonal=True)
                                continue

                            @pl.when(tr != tc)
                            def _off(i=i, rows=rows, cols=cols):
                                store(sub_tile(i), rows=rows, cols=cols, off_diagonal=True)

                            if ei == ej:
                                @pl.when(tr == tc)
                                def _on(i=i, rows=rows, cols=cols):
                                    _store_symmetrized(
                                        sub_tile(i), out_gmem, out_smem, out_t_smem, c_gmem,
                                        c_barrier, wg, bi, rows, cols, beta=beta,
                                        out_dtype=out_dtype)

            def mma_body(idxs, a1_smem, a2_smem, b_smem, acc_ref):
                b_op = b_smem.transpose((1, 0)) if b_transposed else b_smem
                if by_index:
                    (k_idx,) = idxs
                    slot = lax.rem(k_idx, jnp.int32(a_both.shape[1]))
                    plgpu.wgmma(acc_ref, a_both.at[wg, slot], b_op)
                    plgpu.wgmma_wait(config.wgmma_in_flight)
                    return acc_ref

                @pl.when(wg == 0)
                def _wg0():
                    plgpu.wgmma(acc_ref, a1_smem, b_op)

                @pl.when(wg != 0)
                def _wg1():
                    plgpu.wgmma(acc_ref, a2_smem, b_op)

                plgpu.wgmma_wait(config.wgmma_in_flight)
                return acc_ref

            b_panel = (b_gmem.at[bi, pl.ds(tc * tile, tile), :] if b_transposed
                       else b_gmem.at[bi, :, pl.ds(tc * tile, tile)])
            get_pipeline(mma_body, compute_context)(
                a_gmem.at[bi, pl.ds(tr1 * tile, tile), :], a_gmem.at[bi, pl.ds(tr2 * tile, tile), :],
                b_panel, allocations=pipeline_allocs)

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


def _launch(a, b, c, *, out_dtype, config, b_transposed, alpha, beta, interpret,
            diagonal_exact=False, symmetrize_diagonal=True):
    """Pads, launches the kernel on ``(batch, n, ·)`` operands and slices the result back.

    ``symmetrize_diagonal=False`` leaves the diagonal tiles of ``sym_matmul`` as computed (only
    for timing the kernel alone in ``benchmarks/bench_kernels.py``)."""
    batch, n = a.shape[0], a.shape[1]
    if smem_bytes(config, a.dtype, out_dtype) > SMEM_LIMIT:
        raise ValueError(
            f"{config} needs {smem_bytes(config, a.dtype, out_dtype)} bytes of shared memory for "
            f"{a.dtype.name} inputs and {jnp.dtype(out_dtype).name} outputs, more than "
            f"{SMEM_LIMIT}: lower max_concurrent_steps (or epi_cols)")
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
        _symmetric_kernel, config=config, b_transposed=b_transposed,
        diagonal_exact=diagonal_exact, alpha=alpha, beta=beta,
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
        kernel_name="syrk_mosaic" if diagonal_exact else "sym_matmul_mosaic",
    )
    out = kernel(*operands)
    if not diagonal_exact and symmetrize_diagonal and not config.diag_in_epilogue:
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
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    config = config or MosaicConfig.get_default(x.dtype, out_dtype)
    *lead, n, m = x.shape
    x3 = x.reshape(-1, n, m)
    out = _launch(x3, x3, None, out_dtype=out_dtype, config=config, b_transposed=True,
                  alpha=1.0, beta=0.0, interpret=interpret, diagonal_exact=True)
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
    out_dtype = jnp.dtype(a.dtype if out_dtype is None else out_dtype)
    config = config or MosaicConfig.get_default(a.dtype, out_dtype)
    *lead, n, k = a.shape
    a3 = a.reshape(-1, n, k)
    b3 = jnp.broadcast_to(b, (*lead, k, n)).reshape(-1, k, n)
    c3 = None if c is None else jnp.broadcast_to(c, (*lead, n, n)).reshape(-1, n, n)
    if config.b_rows and k != n:
        raise ValueError(f"MosaicConfig(b_rows=True) reads b as a symmetric matrix; b has shape "
                         f"{b.shape[-2:]}")
    out = _launch(a3, b3, c3, out_dtype=out_dtype, config=config, b_transposed=config.b_rows,
                  alpha=float(alpha), beta=float(beta), interpret=interpret)
    return out.reshape(*lead, n, n)
