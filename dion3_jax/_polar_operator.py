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
"""The one way the step meets its polar operator: the :class:`PolarOperator` protocol.

:func:`as_polar_operator` turns what the user passed as ``orthogonalizer=`` into it: ``None``
into the default :class:`BuiltinPolar`, an :class:`dion3_jax.Orthogonalizer` record into a
:class:`BuiltinPolar` with its options, any other callable ``(batch, rows, cols) -> polar
factors`` into a :class:`CallablePolar`. So the step has a single code path:

* ``op(x)``: the polar factors of a batch;
* ``op.stacked(parts, norms)``: the polar factors of ``concatenate(parts)``. The built-in
  operator normalizes each part before the concatenation (the batch is then written once, in
  the compute dtype) and can take each matrix's Frobenius norm from the caller
  (``takes_norms``); a wrapped callable concatenates and calls;
* ``op.of_normalized(x)``: the iteration alone, on a batch the caller normalized and cast to
  ``op.input_dtype`` (only used where ``takes_norms``);
* ``op.padded_shape(shape)``: the ``(rows, cols)`` the iteration runs on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import jax
import jax.numpy as jnp

from dion3_jax._orthogonalizer import Orthogonalizer, polar_options
from dion3_jax._polar import (Backend, _polar_normalized, _polar_parts, iteration_shape,
                              resolved_compute_dtype)


class PolarOperator(Protocol):
    """What the step calls (see the module docstring).

    Attributes:
      takes_norms: ``stacked`` and ``of_normalized`` use norms the caller gives (so the step
        may compute them cheaply and send normalized payloads).
      any_orientation: takes tall matrices as they are (the step then sends each payload in
        its leaf's own orientation and writes no transpose); else only wide ones.
      eps: added to the Frobenius norm before dividing (where ``takes_norms``).
      input_dtype: the dtype a payload normalized by the caller is sent in (where
        ``takes_norms``).
    """

    takes_norms: bool
    any_orientation: bool
    eps: float | None
    input_dtype: jnp.dtype | None

    def __call__(self, x: jax.Array) -> jax.Array: ...

    def stacked(self, parts: Sequence[jax.Array],
                norms: Sequence[jax.Array | None] | None = None) -> jax.Array: ...

    def of_normalized(self, x: jax.Array) -> jax.Array: ...

    def padded_shape(self, shape: tuple[int, int, int]) -> tuple[int, int]: ...


class BuiltinPolar:
    """:func:`dion3_jax.polar` with an :class:`Orthogonalizer`'s options, in the protocol."""

    takes_norms = True
    #: :func:`polar` iterates on the short side's Gram matrix, so tall matrices need no
    #: transpose.
    any_orientation = True

    def __init__(self, options: Orthogonalizer):
        self.options = options
        self._kwargs = polar_options(options)
        self.eps: float | None = options.eps
        self.input_dtype: jnp.dtype | None = jnp.dtype(resolved_compute_dtype(options.method,
                                                            options.compute_dtype))

    @property
    def backend(self) -> Backend:
        """The kernels' ``pallas_kernels`` implementation (``polar``'s ``backend``)."""
        return self.options.backend

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.options(x)

    def stacked(self, parts: Sequence[jax.Array],
                norms: Sequence[jax.Array | None] | None = None) -> jax.Array:
        """``self(jnp.concatenate(parts))`` for ``(b_i, rows, cols)`` parts of one shape and dtype,
        with each part normalized and cast to the compute dtype before the concatenation (so
        the batch is written once, in that dtype; the per-matrix norms are the same).

        Args:
          parts: arrays of one matrix shape and dtype; leading axes are a batch.
          norms: optional, one entry per part: None (the norms are computed from the part), or
            ``‖X‖_F`` of each of the part's matrices, shape ``part.shape[:-2]``, when the caller
            has them already (Dion3 sums them from row statistics of the whole matrix, so the
            gathered rows are read once, for the stack).

        Raises:
          ValueError: parts of different shapes or dtypes, or ``norms`` of the wrong length
            or shape.
        """
        return _polar_parts(list(parts), **self._kwargs,
                            norms=None if norms is None else list(norms))

    def of_normalized(self, x: jax.Array) -> jax.Array:
        """The polar factors of a ``(batch, rows, cols)`` batch the caller has already normalized
        (``X / (‖X‖_F + eps)``) and cast to :attr:`input_dtype`: the iteration alone."""
        return _polar_normalized(x, **self._kwargs)

    def padded_shape(self, shape: tuple[int, int, int]) -> tuple[int, int]:
        """The ``(rows, cols)`` :meth:`of_normalized` iterates on for a ``(batch, rows, cols)``
        batch: padded with zeros to the kernels' tile multiples (the shape itself on XLA). A
        batch the caller writes so padded is iterated on as it is (no pad pass), and its zero
        rows and columns stay exactly zero in the factors."""
        return iteration_shape(shape, self.input_dtype, self.backend)

    def __repr__(self) -> str:
        return f"BuiltinPolar({self.options!r})"


class CallablePolar:
    """A user's ``(batch, rows, cols) -> polar factors`` callable in the protocol."""

    takes_norms = False
    any_orientation = False  # The callable gets wide matrices (rows ≤ cols).
    eps: float | None = None          # The callable normalizes its input itself.
    input_dtype: jnp.dtype | None = None

    def __init__(self, fn: Callable[[jax.Array], jax.Array]):
        self.fn = fn

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fn(x)

    def stacked(self, parts: Sequence[jax.Array],
                norms: Sequence[jax.Array | None] | None = None) -> jax.Array:
        del norms  # the callable normalizes its input itself
        return self.fn(parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0))

    def of_normalized(self, x: jax.Array) -> jax.Array:
        return self.fn(x)

    def padded_shape(self, shape: tuple[int, int, int]) -> tuple[int, int]:
        return shape[1], shape[2]  # the callable gets the batch as it is

    def __repr__(self) -> str:
        return f"CallablePolar({self.fn!r})"


def default_orthogonalizer() -> Orthogonalizer:
    """Gram Newton-Schulz with the Polar Express coefficients and a restart at step 2, in float16.

    The factors come back in the compute dtype: the step casts them to float32 itself, so no
    float32 copy is written and the return all-to-alls move half the bytes.
    """
    return Orthogonalizer(out_dtype=resolved_compute_dtype("gram"))


def as_polar_operator(orthogonalizer) -> PolarOperator:
    """``None`` → :func:`default_orthogonalizer`; an :class:`Orthogonalizer` → its
    :class:`BuiltinPolar`; another callable → :class:`CallablePolar`.

    Raises:
      TypeError: for anything else.
    """
    if orthogonalizer is None:
        orthogonalizer = default_orthogonalizer()
    if isinstance(orthogonalizer, Orthogonalizer):
        return BuiltinPolar(orthogonalizer)
    if not callable(orthogonalizer):
        raise TypeError(f"orthogonalizer must be an Orthogonalizer or a callable, got "
                        f"{orthogonalizer=!r}")
    return CallablePolar(orthogonalizer)
