"""The payload pass of a fully selected matrix: its normalised float16 payload and its decayed
momentum from one read of ``M`` and ``G``.

When every row of a matrix is selected (Dion3 at ``f = 1``, or a matrix with ``k = n``), the step
needs two things of ``S = M + G``: the polar operator's input ``S / (‖S‖_F + ε)`` in the compute
dtype, stacked with the other matrices of its shape, and the new momentum ``μ·S`` (error feedback
of every row). :func:`stack_payloads` computes both in one pass over ``M`` and ``G`` once the norms
are known:

- ``"pallas"``: a Pallas kernel (its Triton lowering, part of jax; NVIDIA GPUs). One launch per
  member writes the member's payload straight into its slot of the stack and its new momentum in
  place of ``M`` (``input_output_aliases``); the slot is a run-time operand, so every member of a
  shape runs the same compiled kernel. 5.5 full-array passes in all with the norm's pass, the
  fewest there are. jax 0.11 marks Pallas' Triton lowering as deprecated (a
  ``DeprecationWarning`` when the step compiles on a GPU); where a jax no longer has it,
  ``"auto"`` resolves to ``"xla"``. A Mosaic GPU port is the planned replacement.
- ``"xla"``: :func:`stack_payloads_reference`, plain jnp. The payloads wait for an optimization
  barrier so that XLA computes each with its momentum in one fusion, and are then written into
  the stack (one more pass over the float16 payloads).

Reference: Amsel et al., *Dion3: Full-Stack Orthogonal Updates*, 2026 (error feedback at
``f = 1``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:  # Pallas' Triton lowering: deprecated in jax 0.11 (module docstring)
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover - a jax without it: "auto" resolves to XLA
    pltriton = None

PayloadImplementation = Literal["auto", "xla", "pallas"]
_KNOWN = ("auto", "xla", "pallas")

#: Elements of one block of the kernel (rows × columns, powers of two).
_BLOCK_ELEMENTS = 4096
#: The widest block row; a member's columns must be a multiple of some power of two ≥ 32.
_MAX_BLOCK_COLS, _MIN_BLOCK_COLS = 512, 32


def _check(ms, gs, denoms) -> None:
    if not ms or len(ms) != len(gs) or len(ms) != len(denoms):
        raise ValueError(f"stack_payloads needs as many momenta, gradients and norms, at least "
                         f"one: got {len(ms)}, {len(gs)}, {len(denoms)}")
    shape = ms[0].shape[1:]
    for i, (m, g, d) in enumerate(zip(ms, gs, denoms)):
        if m.ndim != 3 or m.shape[1:] != shape or g.shape != m.shape:
            raise ValueError(f"member {i}: momentum {m.shape} and gradient {g.shape} must be "
                             f"(batch, *{shape})")
        if jnp.shape(d) != m.shape[:1]:
            raise ValueError(f"member {i}: norms must be ({m.shape[0]},), got {jnp.shape(d)}")


def stack_payloads_reference(ms: Sequence[jax.Array], gs: Sequence[jax.Array],
                             denoms: Sequence[jax.Array], mu, *, out_dtype
                             ) -> tuple[jax.Array, list[jax.Array]]:
    """The plain jnp form of :func:`stack_payloads` (the ``"xla"`` implementation)."""
    sums = [m + g.astype(m.dtype) for m, g in zip(ms, gs)]
    parts = [(s.astype(jnp.float32) / d.astype(jnp.float32)[:, None, None]).astype(out_dtype)
             for s, d in zip(sums, denoms)]
    decayed = [(mu * s).astype(s.dtype) for s in sums]
    if len(parts) == 1:
        return parts[0], decayed
    # Materialised parts (each computed with its momentum's decay, from the same reads) written
    # into a zeroed stack in place: on the H200 an XLA concatenation of many float16 operands
    # copies at 0.8 TB/s, these updates faster.
    parts = jax.lax.optimization_barrier(parts)
    stack = jnp.zeros((sum(p.shape[0] for p in parts), *parts[0].shape[1:]), out_dtype)
    start = 0
    for p in parts:
        stack = jax.lax.dynamic_update_slice_in_dim(stack, p, start, 0)
        start += p.shape[0]
    return stack, decayed


def block_shape(rows: int, cols: int) -> tuple[int, int] | None:
    """The kernel's ``(rows, cols)`` block for matrices of that shape (powers of two dividing
    them, ``_BLOCK_ELEMENTS`` at most), or None when the columns have no such divisor ≥ 32."""
    bc = _MAX_BLOCK_COLS
    while bc >= _MIN_BLOCK_COLS and cols % bc:
        bc //= 2
    if bc < _MIN_BLOCK_COLS:
        return None
    br = max(1, _BLOCK_ELEMENTS // bc)
    while rows % br:
        br //= 2
    return br, bc


def _kernel(slot_ref, denom_ref, mu_ref, m_ref, g_ref, stack_in_ref, m_out_ref, stack_ref, *,
            br: int, bc: int):
    del stack_in_ref  # the same buffer as stack_ref (aliased)
    k, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    s = m_ref[...] + g_ref[...].astype(m_ref.dtype)
    m_out_ref[...] = (mu_ref[0] * s).astype(m_out_ref.dtype)
    payload = (s.astype(jnp.float32) / denom_ref[0]).astype(stack_ref.dtype)
    stack_ref[slot_ref[0] + k, pl.ds(i * br, br), pl.ds(j * bc, bc)] = payload


@functools.partial(jax.jit, static_argnames=("total", "out_dtype", "interpret"))
def _write_member(stack, slot, denom, mu, m, g, *, total: int, out_dtype, interpret: bool):
    """One member's launch: its payload into ``stack[slot : slot + batch]``, its ``μ·S`` in
    place of ``m``. ``stack`` None: the first member allocates the stack of ``total`` matrices
    (the members after it write the other slots). Jitted so that all members of one shape share
    one lowering."""
    b, rows, cols = m.shape
    br, bc = block_shape(rows, cols)
    blk = pl.BlockSpec((None, br, bc), lambda k, i, j: (k, i, j))
    scalar = pl.BlockSpec((1,), lambda k, i, j: (0,))
    per_matrix = pl.BlockSpec((1,), lambda k, i, j: (k,))
    anywhere = pl.BlockSpec(memory_space=pl.ANY)
    fresh = stack is None
    kernel = functools.partial(_kernel, br=br, bc=bc)
    if fresh:
        kernel = functools.partial(_fresh_kernel, kernel)
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(m.shape, m.dtype),
                   jax.ShapeDtypeStruct((total, rows, cols), out_dtype)),
        grid=(b, rows // br, cols // bc),
        in_specs=[scalar, per_matrix, scalar, blk, blk] + ([] if fresh else [anywhere]),
        out_specs=(blk, anywhere),
        input_output_aliases={3: 0} if fresh else {3: 0, 5: 1},
        compiler_params=(None if pltriton is None
                         else pltriton.CompilerParams(num_warps=4, num_stages=1)),
        interpret=interpret, name="stack_payloads",
    )(slot, denom, mu, m, g, *([] if fresh else [stack]))


def _fresh_kernel(kernel, slot_ref, denom_ref, mu_ref, m_ref, g_ref, m_out_ref, stack_ref):
    kernel(slot_ref, denom_ref, mu_ref, m_ref, g_ref, None, m_out_ref, stack_ref)


def _target() -> tuple[str, str]:
    """``(platform, device kind)`` compiled for: an abstract mesh's device, else the default."""
    abstract = jax.sharding.get_abstract_mesh().abstract_device
    device = abstract if abstract is not None else jax.devices()[0]
    return device.platform, device.device_kind


def _default_is_nvidia_gpu() -> bool:
    platform, kind = _target()
    return platform == "gpu" and "NVIDIA" in kind.upper() and pltriton is not None


def _resolve(implementation: str, rows: int, cols: int, interpret: bool) -> str:
    if implementation not in _KNOWN:
        raise ValueError(f"implementation must be one of {_KNOWN}, got {implementation=!r}")
    fits = block_shape(rows, cols) is not None
    if implementation == "xla" or (implementation == "auto" and not (
            fits and _default_is_nvidia_gpu())):
        return "xla"
    if not fits:
        raise ValueError(f"implementation='pallas' needs matrices whose columns are a multiple "
                         f"of {_MIN_BLOCK_COLS}, got ({rows}, {cols}); use 'xla'")
    if not (interpret or _default_is_nvidia_gpu()):
        raise ValueError(f"implementation='pallas' runs on NVIDIA GPUs with jax's Pallas Triton "
                         f"lowering (or with interpret=True), not on {_target()[1]!r}; use 'xla'")
    return "pallas"


def stack_payloads(ms: Sequence[jax.Array], gs: Sequence[jax.Array],
                   denoms: Sequence[jax.Array], mu, *, out_dtype,
                   implementation: PayloadImplementation = "auto", interpret: bool = False
                   ) -> tuple[jax.Array, list[jax.Array]]:
    """Normalised payloads stacked, and decayed momenta, of fully selected matrices.

    For members ``i`` with ``S_i = M_i + G_i`` (in ``M_i``'s dtype) returns ``(stack,
    decayed)``: ``stack`` is the concatenation along axis 0 of ``S_i / denoms_i`` (per matrix,
    in float32, cast to ``out_dtype``) and ``decayed_i = μ·S_i`` in ``M_i``'s dtype.

    Args:
      ms: momenta, each ``(batch_i, rows, cols)``; one matrix shape for all.
      gs: gradients shaped like ``ms`` (any floating dtype).
      denoms: per member, ``(batch_i,)`` divisors (``‖S‖_F + ε``).
      mu: the decay, a scalar (may be traced).
      out_dtype: the stack's dtype.
      implementation: ``"pallas"`` (the kernel; NVIDIA GPUs, or ``interpret``), ``"xla"``, or
        ``"auto"``: the kernel on an NVIDIA GPU when the columns are a multiple of 32, else XLA.
      interpret: run the kernel through Pallas' interpreter (CPU tests).

    Returns:
      ``(stack, decayed)``: ``(Σ batch_i, rows, cols)`` in ``out_dtype``, and a list like
      ``ms``.

    Raises:
      ValueError: for mismatched members, an unknown implementation, or ``"pallas"`` where it
        cannot run.

    Examples:
      >>> import jax.numpy as jnp
      >>> from pallas_kernels import stack_payloads
      >>> m, g = jnp.ones((1, 4, 32)), jnp.ones((1, 4, 32))
      >>> stack, (new_m, _) = stack_payloads([m, m], [g, g], [jnp.full(1, 2.0)] * 2, 0.5,
      ...                                     out_dtype=jnp.float16, implementation="xla")
      >>> stack.shape, float(stack[0, 0, 0]), float(new_m[0, 0, 0])
      ((2, 4, 32), 1.0, 1.0)
    """
    ms, gs, denoms = list(ms), list(gs), list(denoms)
    _check(ms, gs, denoms)
    _, rows, cols = ms[0].shape
    if _resolve(implementation, rows, cols, interpret) == "xla":
        return stack_payloads_reference(ms, gs, denoms, mu, out_dtype=out_dtype)
    total = sum(m.shape[0] for m in ms)
    mu = jnp.reshape(jnp.asarray(mu, jnp.float32), (1,))
    stack, decayed, slot = None, [], 0
    for m, g, d in zip(ms, gs, denoms):
        new_m, stack = _write_member(stack, jnp.asarray([slot], jnp.int32),
                                     jnp.asarray(d, jnp.float32), mu, m, g, total=total,
                                     out_dtype=jnp.dtype(out_dtype), interpret=interpret)
        decayed.append(new_m)
        slot += m.shape[0]
    return stack, decayed
