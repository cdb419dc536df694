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
"""The payload pass for every row on Hopper with Pallas Mosaic GPU (``plgpu.kernel``).

The same op as :func:`pallas_kernels.stack_payloads` without ``rows`` (Dion3 at ``f = 1``, or a
matrix whose every row is selected): the stack of ``S_i / denoms_i`` in the compute dtype.

One launch per member, each the same compiled kernel for all members of a shape (the member's
position in the stack is a run-time operand): the kernel's code and its compile time do not
grow with the number of matrices. The stack starts as an uninitialized buffer
(``jax.lax.empty``) and every launch writes into it through a mutable ``jax.Ref``, so no launch
copies or clears it, and one kernel serves every member of a batch size. A CTA walks a chunk
of rows of a column strip in blocks through a ring of shared-memory slots: TMA brings ``S``'s
block in, the warpgroup divides it by the matrix's divisor in float32 and rounds it once to the
output dtype, and TMA writes it straight into the stack. So the pass reads ``S`` once and
writes the payload once, with no concatenation.

Reference: :func:`pallas_kernels._payload_reference.stack_payloads_reference` (``"xla"``);
``tests/test_payload_mosaic.py`` compares this kernel against it in GPU interpret mode on the
CPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels._common import (TMA_MIN_MINOR, empty_stack, mosaic_interpret_params,
                                    pow2_divisor)

#: A block holds at least this many elements: one per lane of the warpgroup's strided layout
#: (128 threads), times a vector of 16 bytes at the narrowest dtype.
_MIN_BLOCK = 128 * 8
#: 4-byte scalars per TMA copy of at least 16 bytes.
_ALIGN = 4


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MosaicPayloadConfig:
    """The kernel's blocks: the widest powers of two up to these that divide the matrix.

    The defaults were the fastest of eight block shapes on the 7B-shapes groups (one H200;
    docs/KERNELS.md): 32 × 128 blocks in four slots take 96 KiB of shared memory, so two CTAs
    share a multiprocessor.

    Attributes:
      rows: rows of one block.
      cols: columns of one block (of one CTA's strip).
      chunk: rows of one CTA (at least ``rows``).
      stages: shared-memory slots of the ring.
    """

    rows: int = 32
    cols: int = 128
    chunk: int = 512
    stages: int = 4


def blocks(shape: tuple[int, int], config: MosaicPayloadConfig = MosaicPayloadConfig()
           ) -> tuple[int, int, int] | None:
    """``(rows, cols, chunk)`` for matrices of ``shape``, or None when the kernel does not take
    it (columns without a power-of-two divisor of at least 16, or a block of fewer than 1024
    elements)."""
    br, bc = pow2_divisor(shape[0], config.rows), pow2_divisor(shape[1], config.cols)
    if bc < TMA_MIN_MINOR or br * bc < _MIN_BLOCK:
        return None
    return br, bc, max(br, pow2_divisor(shape[0], config.chunk))


def _body(d_gmem, o_gmem, s_gmem, out_gmem, s_smem, p_smem, d_smem, o_smem, bars, *,
          block: tuple[int, int], steps: int, stages: int):
    """One CTA: chunk ``c`` of column strip ``j`` of the member's matrix ``k``, written to
    matrix ``k + offset`` of the stack."""
    k, j, c = lax.axis_index("k"), lax.axis_index("j"), lax.axis_index("c")
    cols = pl.ds(j * block[1], block[1])

    def rows(t):
        return pl.ds((c * steps + t) * block[0], block[0])

    def fetch(t, slot):
        plgpu.copy_gmem_to_smem(s_gmem.at[k, rows(t), cols], s_smem.at[slot], bars.at[slot])

    plgpu.copy_gmem_to_smem(d_gmem, d_smem, bars.at[stages])
    plgpu.copy_gmem_to_smem(o_gmem, o_smem, bars.at[stages + 1])
    for t in range(min(stages, steps)):
        fetch(t, t)
    plgpu.barrier_wait(bars.at[stages])
    plgpu.barrier_wait(bars.at[stages + 1])
    denom, slab = d_smem[k], k + o_smem[0]

    @pl.loop(0, steps)
    def _(t):
        slot = lax.rem(t, stages)
        plgpu.barrier_wait(bars.at[slot])
        payload = (s_smem[slot].astype(jnp.float32) / denom).astype(p_smem.dtype)
        plgpu.wait_smem_to_gmem(stages - 1, wait_read_only=True)  # this slot's last store
        p_smem[slot] = payload
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(p_smem.at[slot], out_gmem.at[slab, rows(t), cols])

        @pl.when(t + stages < steps)
        def _():
            fetch(t + stages, slot)

    plgpu.wait_smem_to_gmem(0)


def _member_kernel(s: jax.Array, out_dtype, config: MosaicPayloadConfig, interpret):
    """The kernel that writes member ``s``'s payloads into a stack passed as a mutable
    ``jax.Ref``."""
    batch, a, b = s.shape
    found = blocks((a, b), config)
    if found is None:
        raise ValueError(f"the Mosaic payload kernel does not take matrices of shape {(a, b)}")
    br, bc, chunk = found
    stages = min(config.stages, chunk // br)
    return plgpu.kernel(
        functools.partial(_body, block=(br, bc), steps=chunk // br, stages=stages),
        out_type=(),
        scratch_types=[plgpu.SMEM((stages, br, bc), s.dtype),
                       plgpu.SMEM((stages, br, bc), out_dtype),
                       plgpu.SMEM((_padded(batch),), jnp.float32),
                       plgpu.SMEM((_ALIGN,), jnp.int32),
                       plgpu.Barrier(num_barriers=stages + 2)],
        grid=(batch, b // bc, a // chunk), grid_names=("k", "j", "c"),
        interpret=mosaic_interpret_params(interpret), kernel_name="stack_payloads")


def _padded(n: int) -> int:
    """``n`` rounded up to whole TMA copies of 4-byte scalars."""
    return n + -n % _ALIGN


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def _write_member(stack, s, denoms, offset, *, config, interpret):
    """Member ``s``'s payloads written at ``offset`` of ``stack``, in place, divided by
    ``denoms[offset : offset + batch]`` (``denoms``: the whole stack's). Jitted, so that the
    members of one shape share one lowering."""
    d = jax.lax.dynamic_slice_in_dim(jnp.asarray(denoms, jnp.float32), offset, s.shape[0])
    d = jnp.pad(d, (0, -s.shape[0] % _ALIGN), constant_values=1.0)
    o = jnp.pad(jnp.asarray(offset, jnp.int32)[None], (0, _ALIGN - 1))
    ref = jax.new_ref(stack)
    _member_kernel(s, stack.dtype, config, interpret)(d, o, s, ref)
    return ref[...]


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def stack_payloads_mosaic(sums, denoms, *, out_dtype,
                          config: MosaicPayloadConfig = MosaicPayloadConfig(),
                          interpret: bool = False) -> jax.Array:
    """:func:`pallas_kernels.stack_payloads` without ``rows`` through the Mosaic GPU kernel
    (checked arguments; a shape :func:`blocks` takes).

    Args:
      sums: the members' ``S_i``, each ``(batch_i, a, b)``; one matrix shape and dtype for all.
      denoms: ``(Σ batch_i,)`` divisors, one per matrix of the stack.
      out_dtype: the stack's dtype.
      config: the blocks.
      interpret: run through GPU interpret mode (CPU; slow; for tests).

    Returns:
      ``(Σ batch_i, a, b)`` in ``out_dtype``.
    """
    total = sum(s.shape[0] for s in sums)
    stack = empty_stack((total, *sums[0].shape[1:]), out_dtype)
    offset = 0
    for s in sums:
        stack = _write_member(stack, s, denoms, offset, config=config, interpret=interpret)
        offset += s.shape[0]
    return stack
