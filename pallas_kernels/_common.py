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
"""Helpers shared by the kernel wrappers: operand checks, padding to tile multiples, the
scales operand, and the payload kernels' uninitialized stack."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

#: Operand dtypes the kernels take (the tensor cores' 16-bit inputs, float32 accumulation).
KERNEL_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


def check_dtypes(*arrays: jax.Array) -> None:
    """Raises ``ValueError`` unless all operands share one float16/bfloat16 dtype."""
    for x in arrays:
        if jnp.dtype(x.dtype) not in KERNEL_DTYPES:
            raise ValueError(f"the kernels take float16/bfloat16 operands, got {x.dtype=}")
    if len({jnp.dtype(x.dtype) for x in arrays}) != 1:
        raise ValueError(f"operands must share one dtype, got {[str(x.dtype) for x in arrays]}")


def pad_to(x: jax.Array, multiples: tuple[int, ...]) -> jax.Array:
    """Zero-pads the trailing ``len(multiples)`` axes of ``x`` up to multiples of ``multiples``."""
    pads = [(0, 0)] * (x.ndim - len(multiples))
    pads += [(0, -s % m) for s, m in zip(x.shape[-len(multiples):], multiples)]
    if all(hi == 0 for _, hi in pads):
        return x
    return jnp.pad(x, pads)


def scales(alpha, beta) -> jax.Array:
    """``(α, β)`` as the ``(2,)`` float32 operand the ``sym_matmul`` kernels read at run time
    (Python floats or scalar arrays; traced values are fine)."""
    return jnp.stack([jnp.asarray(alpha, jnp.float32), jnp.asarray(beta, jnp.float32)])


#: The narrowest minor extent of a Mosaic kernel's block: 16 elements (a TMA box's rows are at
#: least 16 bytes).
TMA_MIN_MINOR = 16


def pow2_divisor(x: int, cap: int) -> int:
    """The largest power of two up to ``cap`` (a power of two) that divides ``x``."""
    p = cap
    while x % p:
        p //= 2
    return p


def mosaic_interpret_params(interpret):
    """``interpret`` as ``plgpu.kernel`` takes it: ``None``, or GPU interpret-mode parameters
    (``True``: the defaults; or an ``InterpretGPUParams``, e.g. with ``detect_races=True``)."""
    if interpret is False or interpret is None:
        return None
    if interpret is True:
        # Private import: GPU interpret mode has no public path in jax 0.11.2.
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

        return InterpretGPUParams()
    return interpret


def empty_stack(shape: tuple[int, ...], dtype) -> jax.Array:
    """An uninitialized array that kernels write into in place (``input_output_aliases``).

    Typed like any other array of the current mesh (as ``jnp.zeros`` would be): with a type of
    its own, under an explicit mesh, every jitted product that reads it would lower a second
    copy of its kernel."""
    replicated = NamedSharding(jax.sharding.get_abstract_mesh(), PartitionSpec())
    return jax.lax.empty(shape, dtype, out_sharding=replicated)
