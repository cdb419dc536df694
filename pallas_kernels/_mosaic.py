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
"""Symmetric matrix products on Hopper with Pallas Mosaic GPU (``plgpu.kernel``).

One kernel serves both products. Each CTA is persistent (one per SM) and walks work items
``(c, r1, r2)`` of every matrix in the batch (:func:`pallas_kernels._schedule.pair_tile_coords`):
two ``tile × tile`` output tiles, ``{r1, c}`` and ``{r2, c}``, that share their column panel. A
memory warpgroup streams three ``(tile, tile_k)`` operand panels per step (``a[r1]``, ``a[r2]``,
``b[c]``) into shared memory with TMA; two compute warpgroups own one tile each and accumulate in
float32 with ``wgmma`` (the CTA tile is 128×256, as in jax's ``hopper_matmul_mgpu``). Both
row-panel rings live in one ``(2, stages, tile, tile_k)`` buffer indexed by ``[wg, k % stages]``
(no branch around ``wgmma``), and one ``wgmma`` group stays in flight across steps (the operand
slots are released one step later, ``BlockSpec(delay_release=1)``).

- ``syrk``: ``out[r, c] = x[r] · x[c]ᵀ``; the ``x[c]`` panel is fed to ``wgmma`` through a
  transposed shared-memory view (the tensor core transposes 16-bit shared-memory operands for
  free). ``syrk(transpose=True)``, ``out[r, c] = x[:, r]ᵀ · x[:, c]``, reads column panels and
  transposes the left one instead, so a tall matrix's Gram ``xᵀx`` needs no transposed copy.
- ``sym_matmul``: ``out[r, c] = α · a[r, :] · b[:, c] + β · c[r, c]``.

The epilogue goes through 64×64 sub-tiles: ``+ β·c`` (the ``c`` sub-tile comes in by TMA), one
rounding to the output dtype, a TMA store to ``out[r, c]`` and, off the diagonal, a TMA store of
its transpose (a register layout cast to ``WGMMA_TRANSPOSED`` and a transposed shared-memory view)
to ``out[c, r]``. Diagonal tiles are written exactly once, as computed: ``syrk``'s are exactly
symmetric (``x[i] · x[i]ᵀ`` sums each pair of mirrored elements in one order), ``sym_matmul``'s
are symmetric up to one rounding, like XLA's product (``a · b`` of matrices that commute only up
to rounding). Operands are padded to tile multiples by the wrapper and the result is sliced back,
so any size works.

Reference: :func:`pallas_kernels._reference.syrk_reference` and
:func:`pallas_kernels._reference.sym_matmul_reference` (re-exported here) compute the same products
in plain jnp; ``tests/test_kernels.py`` compares this kernel against them (GPU interpret mode on
the CPU) and ``tests/test_kernels_gpu.py`` on a Hopper GPU.
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
from pallas_kernels._common import check_dtypes, mosaic_interpret_params, pad_to, scales
from pallas_kernels._reference import sym_matmul_reference, syrk_reference

__all__ = ("MosaicConfig", "SMEM_LIMIT", "smem_bytes", "sym_matmul_mosaic", "syrk_mosaic",
           "sym_matmul_reference", "syrk_reference")

#: SMs simulated by GPU interpret mode when no abstract device says otherwise.
_INTERPRET_NUM_SMS = 4
#: Compute warpgroups per CTA: one per output tile of a work item.
_COMPUTE_WGS = 2
#: Side of the square epilogue sub-tiles staged in shared memory.
_EPI = 64

#: Shared memory a CTA may use on Hopper (227 KiB) less room for barriers and alignment.
SMEM_LIMIT = 227 * 1024 - 1024


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MosaicConfig:
    """Static tuning of the Mosaic GPU kernel.

    Attributes:
      tile: side of each of the two square output tiles of a work item (a multiple of 64).
      tile_k: depth of one pipelined operand panel along the contraction axis (a positive
        multiple of 16).
      max_concurrent_steps: pipeline depth (operand panels in flight in shared memory); at least
        2, since one step's ``wgmma`` stays in flight.
      num_sms: persistent CTAs to launch; ``None`` takes the device's SM count.
    """

    tile: int = 128
    tile_k: int = 64
    max_concurrent_steps: int = 4
    num_sms: int | None = None

    @classmethod
    def get_default(cls, in_dtype=jnp.float16, out_dtype=jnp.float16) -> "MosaicConfig":
        """The field defaults with the pipeline as deep as shared memory allows for these dtypes.

        4 stages for 16-bit outputs, 3 for float32 outputs (their epilogue staging is twice as
        large).
        """
        config = cls()
        while (smem_bytes(config, in_dtype, out_dtype) > SMEM_LIMIT
               and config.max_concurrent_steps > 2):
            config = dataclasses.replace(config,
                                         max_concurrent_steps=config.max_concurrent_steps - 1)
        return config

    def __post_init__(self):
        if self.tile % 64 or self.tile <= 0:
            raise ValueError(f"{self.tile=} must be a positive multiple of 64")
        if self.tile_k % 16 or self.tile_k <= 0:
            raise ValueError(f"{self.tile_k=} must be a positive multiple of 16")
        if self.max_concurrent_steps < 2:
            raise ValueError(f"{self.max_concurrent_steps=} must be >= 2 (one wgmma group stays "
                             "in flight)")
        if self.num_sms is not None and self.num_sms <= 0:
            raise ValueError(f"{self.num_sms=} must be positive or None")


def smem_bytes(config: MosaicConfig, in_dtype, out_dtype) -> int:
    """Shared memory of the kernel's buffers: the operand ring and the epilogue staging."""
    in_size, out_size = jnp.dtype(in_dtype).itemsize, jnp.dtype(out_dtype).itemsize
    panel = config.tile * config.tile_k * in_size
    staging = 2 * _COMPUTE_WGS * _EPI * _EPI * out_size  # A sub-tile and its mirror per wg.
    return config.max_concurrent_steps * 3 * panel + staging


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
    # jax 0.11's transform classes leave transform_array's body empty, which type checkers read
    # as abstract.
    return (plgpu.TilingTransform((8, swizzle_elems)),  # type: ignore[abstract]
            plgpu.SwizzleTransform(swizzle))  # type: ignore[abstract]


def _in_flight(config: MosaicConfig, k: int) -> int:
    """``wgmma`` groups left in flight after each contraction step, and the steps a panel's slot
    is released late by: 1 (the next step's loads overlap this step's ``wgmma``), or 0 when an
    item has a single step. jax's pipeline then runs one stage, which a release one step late
    would leave with no slot the memory warpgroup waits on between items (a race)."""
    return 1 if k // config.tile_k > 1 else 0


def _contraction(a_gmem, form: str) -> int:
    """The contraction length of ``form``'s left operand (see :func:`_symmetric_kernel`)."""
    return a_gmem.shape[-2] if form[0] == "t" else a_gmem.shape[-1]


def _panel_spec(config: MosaicConfig, dtype, along_k_minor: bool, k: int) -> plgpu.BlockSpec:
    """Block spec of one operand panel: ``(tile, tile_k)`` when the contraction axis is the
    operand's minor one (``along_k_minor``), else ``(tile_k, tile)``."""
    tile, tile_k = config.tile, config.tile_k
    shape, index = ((tile, tile_k), lambda s: (0, s)) if along_k_minor else (
        (tile_k, tile), lambda s: (s, 0))
    return plgpu.BlockSpec(shape, index, transforms=_smem_transforms(shape[1], dtype),
                           memory_space=plgpu.SMEM, delay_release=_in_flight(config, k))


def _operand_specs(config: MosaicConfig, dtype, form: str, k: int):
    """``(a_spec, b_spec)``: the pipeline's block specs of a row panel and of the column panel."""
    return (_panel_spec(config, dtype, form[0] == "n", k),
            _panel_spec(config, dtype, form[1] == "t", k))


def _panel(ref, bi, index, tile: int, along_k_minor: bool):
    """The ``index``-th panel of ``tile`` rows (``along_k_minor``) or columns of ``ref[bi]``."""
    if along_k_minor:
        return ref.at[bi, pl.ds(index * tile, tile), :]
    return ref.at[bi, :, pl.ds(index * tile, tile)]


def _pipeline(a_gmem, b_gmem, *, config: MosaicConfig, form: str):
    """``(get_pipeline, allocations, a_both)``.

    ``get_pipeline(body, compute_context)`` builds the warp-specialized pipeline over the
    contraction steps of three panels (two row panels and the column panel). ``allocations`` are
    its shared-memory buffers, allocated once and reused by every work item, less the two
    row-panel rings: those are ``a_both``, one ``(2, stages, tile, tile_k)`` buffer that the
    compute warpgroups index by ``[wg, k % stages]``.
    """
    tile, k = config.tile, _contraction(a_gmem, form)
    a_spec, b_spec = _operand_specs(config, a_gmem.dtype, form, k)
    a_block = _panel(a_gmem, 0, 0, tile, form[0] == "n")
    b_block = _panel(b_gmem, 0, 0, tile, form[1] == "t")

    def get_pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k // config.tile_k,),
            memory_registers=40,
            in_specs=[a_spec, a_spec, b_spec],
            wg_axis="wg",
            num_compute_wgs=_COMPUTE_WGS,
            max_concurrent_steps=config.max_concurrent_steps,
            compute_context=compute_context,
        )

    ignore = lambda *_, **__: None
    allocations = get_pipeline(ignore, ignore).get_allocations(a_block, a_block, b_block)
    a1_alloc, _, b_alloc = allocations["flat_in_smem_refs"]
    a_both = plgpu.SMEM((2, *a1_alloc.shape), a1_alloc.dtype, transforms=a1_alloc.transforms)
    return get_pipeline, dict(allocations, flat_in_smem_refs=[b_alloc]), a_both


def _store_tile(acc, out_gmem, out_smem, out_t_smem, c_gmem, c_barrier, wg, bi, rows, cols,
                off_diagonal, *, beta, out_dtype):
    """Epilogue of one float32 sub-tile of a warpgroup: ``+ β·c`` (if any; ``beta`` is a float32
    scalar read at run time), one rounding, a TMA store to ``out[bi, rows, cols]`` and, when
    ``off_diagonal``, its transpose to ``out[bi, cols, rows]`` (diagonal tiles are written exactly
    once). ``c`` comes in through this warpgroup's staging buffer, after earlier stores have
    finished reading it."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    if c_gmem is not None:
        plgpu.copy_gmem_to_smem(c_gmem.at[bi, rows, cols], out_smem.at[wg], c_barrier.at[wg])
        plgpu.barrier_wait(c_barrier.at[wg])
        acc = acc + beta * out_smem[wg].astype(jnp.float32)
    out = acc.astype(out_dtype)
    out_smem[wg] = out
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[bi, rows, cols])

    @pl.when(off_diagonal)
    def _mirror():
        out_t = plgpu.layout_cast(out, plgpu.Layout.WGMMA_TRANSPOSED)
        out_t_smem.at[wg].transpose((1, 0))[...] = out_t
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_t_smem.at[wg], out_gmem.at[bi, cols, rows])


def _symmetric_kernel(a_gmem, b_gmem, c_gmem, scale_gmem, out_gmem, *, config: MosaicConfig,
                      form: str, batch: int, tiles_per_side: int):
    """Kernel body: the persistent walk over work items, pipelined wgmma, mirrored epilogue.

    Work item ``(c, r1, r2)``: warpgroup 0 computes ``out[r1, c] = a[r1] · b[c]``, warpgroup 1
    ``out[r2, c]``, each a full ``tile × tile`` float32 accumulator. An upper tile (``r < c``) is
    stored directly and its mirror is the lower one. When ``r2 == r1`` (a single) warpgroup 1's
    result is dropped.

    Args:
      a_gmem: the left operand, ``(batch, n, k)``, or ``(batch, k, n)`` for ``form`` "tn".
      b_gmem: the right operand, ``(batch, k, n)``, or ``(batch, n, k)`` for ``form`` "nt".
      c_gmem: ``(batch, n, n)`` addend in the output dtype, or ``None``.
      scale_gmem: ``(2,)`` float32 ``(α, β)``, read at run time (so every product of one shape
        shares one compiled kernel, whatever its scales), or ``None``: ``α = 1``, no ``c``.
      out_gmem: ``(batch, n, n)`` output.
      config: tile sizes and pipeline depth.
      form: the product, as in BLAS: ``"nn"`` ``a · b``; ``"nt"`` ``a · bᵀ`` (``syrk``: the
        ``b`` row panel is transposed in shared memory); ``"tn"`` ``aᵀ · b`` (``syrk`` of the
        transpose: both operands are read in column panels, the ``a`` panel transposed).
      batch: number of matrices.
      tiles_per_side: ``n / tile``.
    """
    out_dtype = out_gmem.dtype
    tile = config.tile
    get_pipeline, pipeline_allocs, a_both = _pipeline(a_gmem, b_gmem, config=config, form=form)
    in_flight = _in_flight(config, _contraction(a_gmem, form))

    @functools.partial(
        pl.run_scoped,
        pipeline_allocs=pipeline_allocs,
        a_both=a_both,
        out_smem=plgpu.SMEM((_COMPUTE_WGS, _EPI, _EPI), out_dtype,
                            transforms=_smem_transforms(_EPI, out_dtype)),
        out_t_smem=plgpu.SMEM((_COMPUTE_WGS, _EPI, _EPI), out_dtype),
        c_barrier=None if c_gmem is None else plgpu.Barrier(num_barriers=_COMPUTE_WGS),
        collective_axes="wg",
    )
    def _scope(pipeline_allocs, a_both, out_smem, out_t_smem, c_barrier):
        wg = lax.axis_index("wg")
        (b_ref,) = pipeline_allocs["flat_in_smem_refs"]
        pipeline_allocs = dict(pipeline_allocs,
                               flat_in_smem_refs=[a_both.at[0], a_both.at[1], b_ref])
        num_items = _schedule.num_pair_items(tiles_per_side)
        # The scales, read once per CTA (loop invariants of the walk below).
        alpha = None if scale_gmem is None else scale_gmem[0]
        beta = None if c_gmem is None else scale_gmem[1]

        @plgpu.nd_loop((batch * num_items,), collective_axes="sm")
        def _item_loop(loop_info: plgpu.NDLoopInfo):
            (lin_idx,) = loop_info.index
            bi, tc, tr1, tr2 = _schedule.batched_pair_tile_coords(lin_idx, tiles_per_side)
            tr = lax.select(wg == 0, tr1, tr2)  # This warpgroup's row panel.
            keep = jnp.logical_or(wg == 0, tr1 != tr2)  # A single's second copy is dropped.
            subs = [(pl.ds(tr * tile + ei * _EPI, _EPI), pl.ds(tc * tile + ej * _EPI, _EPI))
                    for ei in range(tile // _EPI) for ej in range(tile // _EPI)]

            def compute_context(eval_pipeline):
                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile, tile), jnp.float32))
                def _acc_scope(acc_ref):
                    with jax.named_scope("mainloop"):  # Named for Mosaic GPU's profiler.
                        eval_pipeline(acc_ref)
                    acc = acc_ref[...]
                    if alpha is not None:
                        acc = acc * alpha

                    @pl.when(keep)
                    @jax.named_scope("epilogue")
                    def _store():
                        for i, (rows, cols) in enumerate(subs):
                            ei, ej = divmod(i, tile // _EPI)
                            sub = acc[ei * _EPI:(ei + 1) * _EPI, ej * _EPI:(ej + 1) * _EPI]
                            _store_tile(sub, out_gmem, out_smem, out_t_smem, c_gmem, c_barrier,
                                        wg, bi, rows, cols, tr != tc, beta=beta,
                                        out_dtype=out_dtype)

            def mma_body(idxs, a1_smem, a2_smem, b_smem, acc_ref):
                del a1_smem, a2_smem  # Read through a_both, by warpgroup.
                (k_idx,) = idxs
                b_op = b_smem.transpose((1, 0)) if form[1] == "t" else b_smem
                slot = lax.rem(k_idx, jnp.int32(a_both.shape[1]))
                a_op = a_both.at[wg, slot]
                plgpu.wgmma(acc_ref, a_op.transpose((1, 0)) if form[0] == "t" else a_op, b_op)
                plgpu.wgmma_wait(in_flight)
                return acc_ref

            b_panel = _panel(b_gmem, bi, tc, tile, form[1] == "t")
            a1_panel = _panel(a_gmem, bi, tr1, tile, form[0] == "n")
            a2_panel = _panel(a_gmem, bi, tr2, tile, form[0] == "n")
            get_pipeline(mma_body, compute_context)(a1_panel, a2_panel, b_panel,
                                                    allocations=pipeline_allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _padded_product(a, b, c, scale, *, out_dtype, config, form: str, interpret, name: str):
    """Pads ``(batch, n, ·)`` operands to tile multiples and launches the kernel.

    ``scale``: the ``(2,)`` float32 ``(α, β)`` of :func:`_symmetric_kernel`, or ``None`` (``α =
    1``, no ``c``).

    Returns:
      The padded ``(batch, n_p, n_p)`` kernel output: off-diagonal tiles mirrored, diagonal tiles
      as computed.

    Raises:
      ValueError: when ``config`` needs more shared memory than a Hopper CTA has.
    """
    batch = a.shape[0]
    need = smem_bytes(config, a.dtype, out_dtype)
    if need > SMEM_LIMIT:
        raise ValueError(
            f"{config} needs {need} bytes of shared memory for {a.dtype.name} inputs and "
            f"{jnp.dtype(out_dtype).name} outputs, more than {SMEM_LIMIT}: lower "
            "max_concurrent_steps")
    tile, tile_k = config.tile, config.tile_k
    a_p = pad_to(a, (tile, tile_k) if form[0] == "n" else (tile_k, tile))
    b_p = pad_to(b, (tile, tile_k) if form[1] == "t" else (tile_k, tile))
    n_p = a_p.shape[1 if form[0] == "n" else 2]
    c_p = None if c is None else pad_to(c.astype(out_dtype), (tile, tile))
    body = functools.partial(_symmetric_kernel, config=config, form=form, batch=batch,
                             tiles_per_side=n_p // tile)

    def body_fn(a_ref, b_ref, *refs):  # refs: [c], [scale], out
        c_ref = refs[0] if c_p is not None else None
        scale_ref = refs[-2] if scale is not None else None
        body(a_ref, b_ref, c_ref, scale_ref, refs[-1])

    kernel = plgpu.kernel(
        body_fn,
        out_type=jax.ShapeDtypeStruct((batch, n_p, n_p), out_dtype),
        grid=(_num_sms(config, interpret),),
        grid_names=("sm",),
        num_threads=_COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=mosaic_interpret_params(interpret),
        kernel_name=name,
    )
    return kernel(a_p, b_p, *[x for x in (c_p, scale) if x is not None])


@functools.partial(jax.jit, static_argnames=("transpose", "out_dtype", "config", "interpret"))
def syrk_mosaic(x: jax.Array, *, transpose: bool = False, out_dtype=None,
                config: MosaicConfig | None = None, interpret: bool = False) -> jax.Array:
    """``x · xᵀ`` (or ``xᵀ · x``) over the last two axes with the Mosaic GPU kernel.

    Args:
      x: ``(..., n, m)`` float16 or bfloat16.
      transpose: compute ``xᵀ · x`` (``(..., m, m)``): both operands are read in column panels
        and the left one is transposed in shared memory, so a tall ``x`` needs no transpose.
      out_dtype: output dtype (default ``x.dtype``).
      config: tile sizes (default :meth:`MosaicConfig.get_default`).
      interpret: run through GPU interpret mode (CPU; slow; for tests); ``True`` or an
        ``InterpretGPUParams`` (e.g. with ``detect_races=True``).

    Returns:
      ``(..., n, n)`` (``(..., m, m)`` with ``transpose``), accumulated in float32 and rounded
      once; exactly symmetric.
    """
    check_dtypes(x)
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    config = config or MosaicConfig.get_default(x.dtype, out_dtype)
    *lead, rows, cols = x.shape
    x3 = x.reshape(-1, rows, cols)
    n = cols if transpose else rows
    out = _padded_product(x3, x3, None, None, out_dtype=out_dtype, config=config,
                          form="tn" if transpose else "nt", interpret=interpret,
                          name="syrk_mosaic")
    return out[:, :n, :n].reshape(*lead, n, n)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def sym_matmul_mosaic(a: jax.Array, b: jax.Array, c: jax.Array | None = None, *, alpha=1.0,
                      beta=0.0, out_dtype=None, config: MosaicConfig | None = None,
                      interpret: bool = False) -> jax.Array:
    """``α · a · b + β · c`` for a symmetric result, with the Mosaic GPU kernel.

    Only the lower tiles are computed; the upper ones are their exact mirror. Diagonal tiles are as
    computed: symmetric up to one rounding when ``a`` and ``b`` commute up to rounding. ``c`` must
    be symmetric (its lower tiles are read).

    ``α`` and ``β`` reach the kernel at run time, as float32 scalars: every call of one shape and
    dtype runs one compiled kernel (a Gram Newton-Schulz polar makes about 14 products per shape
    with a dozen distinct scales; static scales would compile a kernel for each).

    Args:
      a: ``(..., n, k)`` float16 or bfloat16.
      b: ``(..., k, n)``, same dtype.
      c: optional symmetric ``(..., n, n)``; read whenever given (``β = 0`` adds ``0·c``).
      alpha: scale of the product (a float or a float32 scalar array; may be traced).
      beta: scale of ``c`` (likewise).
      out_dtype: output dtype (default ``a.dtype``).
      config: tile sizes (default :meth:`MosaicConfig.get_default`).
      interpret: run through GPU interpret mode (CPU; slow; for tests); ``True`` or an
        ``InterpretGPUParams`` (e.g. with ``detect_races=True``).

    Returns:
      ``(..., n, n)``, accumulated in float32 and rounded once; off-diagonal tiles exactly
      mirrored.
    """
    check_dtypes(a, b)
    out_dtype = jnp.dtype(a.dtype if out_dtype is None else out_dtype)
    config = config or MosaicConfig.get_default(a.dtype, out_dtype)
    *lead, n, k = a.shape
    a3 = a.reshape(-1, n, k)
    b3 = jnp.broadcast_to(b, (*lead, k, n)).reshape(-1, k, n)
    c3 = None if c is None else jnp.broadcast_to(c, (*lead, n, n)).reshape(-1, n, n)
    out = _padded_product(a3, b3, c3, scales(alpha, beta), out_dtype=out_dtype, config=config,
                          form="nn", interpret=interpret, name="sym_matmul_mosaic")
    return out[:, :n, :n].reshape(*lead, n, n)
