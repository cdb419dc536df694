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
"""The payload pass as a Pallas kernel through Pallas' Triton lowering (NVIDIA GPUs).

The same op as :func:`pallas_kernels.stack_payloads`. The stack starts uninitialized (zeroed
when padding rows must stay zero), and one launch per member writes the member's payload
straight into its slot of it (``input_output_aliases``); the slot is a run-time operand, so
every member of a shape runs the same compiled kernel. With ``rows``, each block
stores its selected rows (or, for rows along the minor axis, columns) at their payload positions
under a mask. jax 0.11 deprecates this lowering, so :func:`pallas_kernels.stack_payloads` runs
the kernel only when it is named.

Reference: :func:`pallas_kernels._payload_reference.stack_payloads_reference` (``"xla"``);
``tests/test_payload.py`` compares this kernel against it in Pallas' interpreter.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _dispatch
from pallas_kernels._common import empty_stack
from pallas_kernels._payload_reference import split

#: A member's columns must be a multiple of some power of two ≥ 32 (the narrowest block row).
MIN_BLOCK_COLS = 32


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PayloadConfig:
    """The kernel's launch parameters (the defaults are what :func:`stack_payloads` runs;
    ``benchmarks/bench_payload.py`` times others).

    Attributes:
      block_elements: elements of one block, rows × columns (a power of two).
      max_block_cols: the widest block row (a power of two ≥ 32); a block takes the widest power
        of two up to it that divides the columns.
      num_warps: warps per block.
    """

    block_elements: int = 4096
    max_block_cols: int = 512
    num_warps: int = 4


def _positions(rows: jax.Array, n: int) -> jax.Array:
    """``(batch, n)`` int32: each row's position in ``rows`` (``(batch, pick)``), ``pick`` for
    rows not selected; indices ≥ ``n`` (padding) are dropped."""
    batch, pick = rows.shape
    pos = jnp.full((batch, n), pick, jnp.int32)
    return jax.vmap(lambda p, r: p.at[r].set(jnp.arange(pick, dtype=jnp.int32),
                                             unique_indices=True, mode="drop"))(pos, rows)


def block_shape(rows: int, cols: int, config: PayloadConfig = PayloadConfig()
                ) -> tuple[int, int] | None:
    """The kernel's ``(rows, cols)`` block for matrices of that shape (powers of two dividing
    them, ``config.block_elements`` at most), or None when the columns have no such divisor
    ≥ 32."""
    bc = config.max_block_cols
    while bc >= MIN_BLOCK_COLS and cols % bc:
        bc //= 2
    if bc < MIN_BLOCK_COLS:
        return None
    br = max(1, config.block_elements // bc)
    while rows % br:
        br //= 2
    return br, bc


def _kernel(slot_ref, denom_ref, s_ref, stack_in_ref, stack_ref, *, br: int, bc: int):
    """One block of a member. ``denom_ref`` holds the whole stack's divisors: the block reads
    its matrix's at its stack slot."""
    del stack_in_ref  # the same buffer as stack_ref (aliased)
    k, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    payload = (s_ref[...].astype(jnp.float32) / denom_ref[slot_ref[0] + k]).astype(
        stack_ref.dtype)
    stack_ref[slot_ref[0] + k, pl.ds(i * br, br), pl.ds(j * bc, bc)] = payload


def _select_kernel(slot_ref, denom_ref, pos_ref, s_ref, stack_in_ref, stack_ref, *, br: int,
                   bc: int, pick: int, row_axis: int):
    """:func:`_kernel` for selected rows: ``pos_ref`` holds the block's rows' payload positions
    (``pick``: not selected); the selected ones are stored at them under a mask."""
    del stack_in_ref  # the same buffer as stack_ref (aliased)
    k, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    pos = pos_ref[...]
    if row_axis == 2:   # the selected rows are columns of the block
        keep = jnp.broadcast_to((pos < pick)[None, :], (br, bc))
        at_row = i * br + jax.lax.broadcasted_iota(jnp.int32, (br, bc), 0)
        at_col = jnp.broadcast_to(pos[None, :], (br, bc))
    else:
        keep = jnp.broadcast_to((pos < pick)[:, None], (br, bc))
        at_row = jnp.broadcast_to(pos[:, None], (br, bc))
        at_col = j * bc + jax.lax.broadcasted_iota(jnp.int32, (br, bc), 1)
    payload = (s_ref[...].astype(jnp.float32) / denom_ref[slot_ref[0] + k]).astype(
        stack_ref.dtype)
    _dispatch.pallas_triton().store(stack_ref.at[slot_ref[0] + k, at_row, at_col], payload,
                                    mask=keep)


@functools.partial(jax.jit, static_argnames=("row_axis", "interpret", "config"))
def _write_member(stack, slot, denoms, s, pos, *, row_axis: int, interpret: bool,
                  config: PayloadConfig):
    """One member's launch: its payloads into ``stack[slot : slot + batch]`` in place, divided by
    ``denoms[slot : slot + batch]`` (``denoms``: the whole stack's divisors, one array for every
    launch, so no member needs its own slice of them); ``pos`` None: every row, else each row's
    payload position. Jitted so that all members of one shape share one lowering."""
    b, rows, cols = s.shape
    found = block_shape(rows, cols, config)
    if found is None:
        raise ValueError(f"the Triton payload kernel does not take matrices of shape "
                         f"{(rows, cols)}")
    br, bc = found
    blk = pl.BlockSpec((None, br, bc), lambda k, i, j: (k, i, j))
    scalar = pl.BlockSpec((1,), lambda k, i, j: (0,))
    anywhere = pl.BlockSpec(memory_space=pl.ANY)
    if pos is None:
        kernel, pos_spec = functools.partial(_kernel, br=br, bc=bc), []
    else:
        kernel = functools.partial(_select_kernel, br=br, bc=bc, pick=stack.shape[row_axis],
                                   row_axis=row_axis)
        pos_spec = [pl.BlockSpec((None, bc), lambda k, i, j: (k, j)) if row_axis == 2
                    else pl.BlockSpec((None, br), lambda k, i, j: (k, i))]
    operands = [slot, denoms] + ([] if pos is None else [pos]) + [s]
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(stack.shape, stack.dtype),
        grid=(b, rows // br, cols // bc),
        in_specs=[scalar, anywhere] + pos_spec + [blk, anywhere],
        out_specs=anywhere,
        input_output_aliases={len(operands): 0},
        compiler_params=_dispatch.triton_params(config.num_warps, interpret),
        interpret=interpret, name="stack_payloads",
    )(*operands, stack)


def stack_payloads_triton(sums, denoms, *, out_dtype, rows=None, row_axis: int = 1,
                          padded: bool = True, interpret: bool = False,
                          config: PayloadConfig = PayloadConfig(),
                          zero_from: int | None = None) -> jax.Array:
    """:func:`pallas_kernels.stack_payloads` through the kernel (checked arguments), one launch
    per member with the launch parameters ``config``. ``zero_from``: the payload rows from it
    on are padding (``rows`` holds indices ≥ n there), zeroed after the launches unless
    ``padded`` zeroed the whole stack first."""
    _, a, b = sums[0].shape
    total = sum(s.shape[0] for s in sums)
    part = (a, b) if rows is None else ((rows.shape[1], b) if row_axis == 1
                                         else (a, rows.shape[1]))
    denoms = jnp.asarray(denoms, jnp.float32)
    # Payload rows of padding indices are never written: the stack starts zeroed then.
    stack = (jnp.zeros if rows is not None and padded else empty_stack)((total, *part),
                                                                        out_dtype)
    # The index work runs once for all members, on the stacked rows.
    pos = ([None] * len(sums) if rows is None
           else split(_positions(rows, sums[0].shape[row_axis]), [s.shape[0] for s in sums]))
    slot = 0
    for s, p in zip(sums, pos):
        stack = _write_member(stack, jnp.asarray([slot], jnp.int32), denoms, s, p,
                              row_axis=row_axis, interpret=interpret, config=config)
        slot += s.shape[0]
    if not padded and zero_from is not None and zero_from < part[row_axis - 1]:
        tail = list(stack.shape)
        tail[row_axis] -= zero_from
        stack = jax.lax.dynamic_update_slice_in_dim(stack, jnp.zeros(tail, stack.dtype),
                                                    zero_from, row_axis)
    return stack
