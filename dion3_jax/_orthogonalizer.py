"""The one way the step meets its polar operator: an :class:`Orthogonalizer`.

:func:`make_orthogonalizer` configures :func:`dion3_jax.polar` (method, coefficients, restarts,
compute dtype, kernel backend). A plain callable ``(batch, rows, cols) -> polar factors`` is
wrapped by :func:`as_orthogonalizer` into the same protocol, so the step has a single code path:

* ``orth(x)``: the polar factors of a batch;
* ``orth.stacked(parts, norms)``: the polar factors of ``concatenate(parts)``. The built-in
  orthogonalizer normalises each part before the concatenation (the batch is then written once,
  in the compute dtype) and can take each matrix's Frobenius norm from the caller
  (``takes_norms``); a wrapped callable concatenates and calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import inspect

import jax
import jax.numpy as jnp

from dion3_jax._polar import (_polar_normalized, _polar_parts, iteration_shape, polar,
                              resolved_compute_dtype)

_POLAR_DEFAULTS = {name: p.default for name, p in inspect.signature(polar).parameters.items()
                   if p.kind is inspect.Parameter.KEYWORD_ONLY}


class Orthogonalizer:
    """``f(batch) = polar(batch, **polar_kwargs)``; see :func:`make_orthogonalizer`."""

    #: ``stacked`` uses the norms it is given (so the caller may compute them cheaply).
    takes_norms = True
    #: Takes tall matrices as they are (:func:`polar` iterates on the short side's Gram matrix),
    #: so the step sends each payload in its leaf's own orientation and writes no transpose.
    any_orientation = True

    def __init__(self, **polar_kwargs):
        self.polar_kwargs = dict(polar_kwargs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return polar(x, **self.polar_kwargs)

    @property
    def input_dtype(self):
        """The dtype the iteration runs in: a payload normalised by the caller may be sent in it."""
        return jnp.dtype(resolved_compute_dtype(self.polar_kwargs.get("method", "gram"),
                                                self.polar_kwargs.get("compute_dtype")))

    @property
    def backend(self) -> str:
        """The kernels' ``pallas_kernels`` implementation (``polar``'s ``backend``)."""
        return self.polar_kwargs.get("backend", _POLAR_DEFAULTS["backend"])

    @property
    def eps(self) -> float:
        """Added to the Frobenius norm before dividing (``polar``'s ``eps``)."""
        return self.polar_kwargs.get("eps", _POLAR_DEFAULTS["eps"])

    def stacked(self, parts: Sequence[jax.Array],
                norms: Sequence[jax.Array | None] | None = None) -> jax.Array:
        """``self(jnp.concatenate(parts))`` for ``(b_i, rows, cols)`` parts of one shape and dtype,
        with each part normalised and cast to the compute dtype before the concatenation (so
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
        return _polar_parts(list(parts), **{**_POLAR_DEFAULTS, **self.polar_kwargs},
                            norms=None if norms is None else list(norms))

    def of_normalized(self, x: jax.Array) -> jax.Array:
        """The polar factors of a ``(batch, rows, cols)`` batch the caller has already normalised
        (``X / (‖X‖_F + eps)``) and cast to :attr:`input_dtype`: the iteration alone."""
        return _polar_normalized(x, **{**_POLAR_DEFAULTS, **self.polar_kwargs})

    def padded_shape(self, shape: tuple[int, int, int]) -> tuple[int, int]:
        """The ``(rows, cols)`` :meth:`of_normalized` iterates on for a ``(batch, rows, cols)``
        batch: padded with zeros to the kernels' tile multiples (the shape itself on XLA). A
        batch the caller writes so padded is iterated on as it is (no pad pass), and its zero
        rows and columns stay exactly zero in the factors."""
        return iteration_shape(shape, self.input_dtype, self.backend)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.polar_kwargs.items())
        return f"Orthogonalizer({args})"


class CallableOrthogonalizer(Orthogonalizer):
    """A user's ``(batch, rows, cols) -> polar factors`` callable in the protocol."""

    takes_norms = False
    any_orientation = False  # The callable gets wide matrices (rows ≤ cols).

    def __init__(self, fn: Callable[[jax.Array], jax.Array]):
        super().__init__()
        self.fn = fn

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fn(x)

    def stacked(self, parts, norms=None) -> jax.Array:
        del norms  # the callable normalises its input itself
        return self.fn(parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0))

    def of_normalized(self, x: jax.Array) -> jax.Array:
        return self.fn(x)

    def padded_shape(self, shape: tuple[int, int, int]) -> tuple[int, int]:
        return tuple(shape[1:])  # the callable gets the batch as it is

    def __repr__(self) -> str:
        return f"CallableOrthogonalizer({self.fn!r})"


def make_orthogonalizer(**polar_kwargs) -> Orthogonalizer:
    """Returns ``f(batch) = polar(batch, **polar_kwargs)``, validated now rather than at trace.

    This is how the polar operator of :func:`dion3_jax.scale_by_dion3` and :func:`dion3_jax.dion3`
    is configured (their ``orthogonalizer=`` argument).

    The result also has ``f.stacked(parts)``: the polar factors of ``jnp.concatenate(parts)``
    with each part normalised before the concatenation (what Dion3's megabatching calls on one
    device: the group's batch is then assembled once, in the compute dtype).

    Args:
      **polar_kwargs: keyword arguments of :func:`dion3_jax.polar` (``method``,
        ``coefficients``, ``restarts``, ``steps``, ``compute_dtype``, ``backend``, ``eps``,
        ``out_dtype``).

    Returns:
      An :class:`Orthogonalizer`: a callable mapping a ``(batch, rows, cols)`` array to its polar
      factors.

    Raises:
      ValueError: for a bad keyword argument.

    Examples:
      >>> import jax.numpy as jnp
      >>> from dion3_jax import make_orthogonalizer
      >>> f = make_orthogonalizer(method="gram", backend="xla")
      >>> a, b = jnp.ones((2, 8, 32)), jnp.ones((3, 8, 32))
      >>> f(a).shape, f.stacked([a, b]).shape
      ((2, 8, 32), (5, 8, 32))
    """
    unknown = set(polar_kwargs) - set(_POLAR_DEFAULTS)
    if unknown:
        raise ValueError(f"make_orthogonalizer: unknown keyword(s) {sorted(unknown)}; polar takes "
                         f"{sorted(_POLAR_DEFAULTS)}")
    jax.eval_shape(lambda: polar(jnp.zeros((1, 2, 3), jnp.float32), **polar_kwargs))  # validates
    return Orthogonalizer(**polar_kwargs)


def default_orthogonalizer() -> Orthogonalizer:
    """Gram Newton-Schulz with the Polar Express coefficients and a restart at step 2, in float16.

    The factors come back in the compute dtype: the step casts them to float32 itself, so no
    float32 copy is written and the return all-to-alls move half the bytes.
    """
    return make_orthogonalizer(out_dtype=resolved_compute_dtype("gram"))


def as_orthogonalizer(orthogonalizer) -> Orthogonalizer:
    """``None`` → :func:`default_orthogonalizer`; an :class:`Orthogonalizer` as it is; another
    callable wrapped in :class:`CallableOrthogonalizer`."""
    if orthogonalizer is None:
        return default_orthogonalizer()
    if isinstance(orthogonalizer, Orthogonalizer):
        return orthogonalizer
    if not callable(orthogonalizer):
        raise TypeError(f"orthogonalizer must be an Orthogonalizer or a callable, got "
                        f"{orthogonalizer=!r}")
    return CallableOrthogonalizer(orthogonalizer)
