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
"""How a user configures the optimizer's polar operator: an :class:`Orthogonalizer` record.

:func:`make_orthogonalizer` returns one; it is passed as ``orthogonalizer=`` to
:func:`dion3_jax.scale_by_dion3` and the aliases. The record holds :func:`dion3_jax.polar`'s
keyword options and nothing else; how the step calls it (stacked parts, payloads normalized by
the caller, padded shapes) is the private protocol of ``_polar_operator``.
"""

from collections.abc import Sequence
import dataclasses

import jax
import jax.numpy as jnp

from dion3_jax._polar import Backend, Method, Preconditioning, polar


@dataclasses.dataclass(frozen=True, kw_only=True)
class Orthogonalizer:
    """The keyword options of :func:`dion3_jax.polar`, validated at construction.

    Calling it runs :func:`dion3_jax.polar` with them: ``orth(x) = polar(x, **options)`` for a
    ``(..., rows, cols)`` array. Build it with :func:`make_orthogonalizer` and pass it as
    ``orthogonalizer=``. Records with the same options compare equal; sequences are stored as
    tuples and dtypes as ``numpy.dtype`` so that a record is hashable (``jax.jit`` of it caches).

    Attributes:
      method: ``"gram"`` (Gram Newton-Schulz with restarts) or ``"standard"``.
      coefficients: a preset name or a sequence of ``(a, b, c)`` triples, one per step.
      restarts: 0-based steps at which Gram Newton-Schulz restarts.
      steps: number of steps (default: the length of the coefficient list).
      compute_dtype: dtype of the iteration (default: float16 for ``"gram"``, bfloat16 for
        ``"standard"``).
      backend: the symmetric products' ``pallas_kernels`` implementation.
      eps: added to the Frobenius norm before dividing.
      out_dtype: dtype of the factors (default: the input's).
      preconditioning: the first step's rescaling (``"none"``, ``"norm_bound"``, ``"aol"``).
    """

    method: Method = "gram"
    coefficients: str | Sequence[Sequence[float]] = "polar_express"
    restarts: Sequence[int] = (2,)
    steps: int | None = None
    compute_dtype: jax.typing.DTypeLike | None = None
    backend: Backend = "auto"
    eps: float = 1e-7
    out_dtype: jax.typing.DTypeLike | None = None
    preconditioning: Preconditioning = "none"

    def __post_init__(self):
        options = polar_options(self)
        jax.eval_shape(lambda: polar(jnp.zeros((1, 2, 3), jnp.float32), **options))  # validates
        coefficients = self.coefficients
        if not isinstance(coefficients, str):
            coefficients = tuple(tuple(t) for t in coefficients)
        for name, value in (("coefficients", coefficients), ("restarts", tuple(self.restarts)),
                            ("compute_dtype", _dtype(self.compute_dtype)),
                            ("out_dtype", _dtype(self.out_dtype))):
            object.__setattr__(self, name, value)

    def __call__(self, x: jax.Array) -> jax.Array:
        """``polar(x, **options)``: the polar factors of each matrix of ``x``."""
        return polar(x, **polar_options(self))


def _dtype(dtype):
    return None if dtype is None else jnp.dtype(dtype)


def polar_options(orthogonalizer: Orthogonalizer) -> dict:
    """The record's fields as :func:`dion3_jax.polar`'s keyword arguments."""
    return {f.name: getattr(orthogonalizer, f.name) for f in dataclasses.fields(orthogonalizer)}


def make_orthogonalizer(
    *,
    method: Method = "gram",
    coefficients: str | Sequence[Sequence[float]] = "polar_express",
    restarts: Sequence[int] = (2,),
    steps: int | None = None,
    compute_dtype: jax.typing.DTypeLike | None = None,
    backend: Backend = "auto",
    eps: float = 1e-7,
    out_dtype: jax.typing.DTypeLike | None = None,
    preconditioning: Preconditioning = "none",
) -> Orthogonalizer:
    """Returns ``f(batch) = polar(batch, **options)``, validated now rather than at trace.

    This is how the polar operator of :func:`dion3_jax.scale_by_dion3` and :func:`dion3_jax.dion3`
    is configured (their ``orthogonalizer=`` argument). With the built-in operator the step
    normalizes each part of a shape group before stacking it (the group's batch is then written
    once, in the compute dtype) and can take the norms from its row statistics.

    Its parameters are :func:`dion3_jax.polar`'s keyword options, with the same names, defaults
    and types (``tests/test_signatures.py`` checks that they agree).

    Args:
      method: ``"gram"`` (Gram Newton-Schulz with restarts) or ``"standard"``.
      coefficients: a preset name (:data:`dion3_jax.newton_schulz.COEFFICIENT_PRESETS`) or a
        sequence of ``(a, b, c)`` triples, one per step.
      restarts: 0-based steps at which Gram Newton-Schulz restarts.
      steps: number of steps (default: the length of the coefficient list).
      compute_dtype: dtype of the iteration (default: float16 for ``"gram"``, bfloat16 for
        ``"standard"``).
      backend: the symmetric products' ``pallas_kernels`` implementation (``"auto"``,
        ``"xla"``, ``"mosaic"`` or ``"jax_triton"``).
      eps: added to the Frobenius norm before dividing.
      out_dtype: dtype of the factors (default: the input's).
      preconditioning: the first step's rescaling, read off the first Gram matrix: ``"none"``,
        ``"norm_bound"`` (one scale per matrix; keeps the polar factor) or ``"aol"`` (per-row
        scales; converges to the polar factor of the rescaled matrix).

    Returns:
      An :class:`Orthogonalizer`: a record of the options that maps a ``(batch, rows, cols)``
      array to its polar factors when called.

    Raises:
      ValueError: for a bad option value (as :func:`dion3_jax.polar` would raise at trace).

    Examples:
      >>> import jax.numpy as jnp
      >>> from dion3_jax import make_orthogonalizer
      >>> f = make_orthogonalizer(method="gram", backend="xla")
      >>> f.method, f.backend, f.restarts
      ('gram', 'xla', (2,))
      >>> f(jnp.ones((2, 8, 32))).shape
      (2, 8, 32)
    """
    return Orthogonalizer(method=method, coefficients=coefficients, restarts=restarts,
                          steps=steps, compute_dtype=compute_dtype, backend=backend, eps=eps,
                          out_dtype=out_dtype, preconditioning=preconditioning)
