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
"""The polar operator: standard and Gram Newton-Schulz on batches of matrices.

``polar(X) = U Vᵀ`` for ``X = U Σ Vᵀ``, approximated by a few steps of an odd polynomial
iteration on the singular values. Gram Newton-Schulz iterates on the small symmetric Gram matrix
``X Xᵀ`` instead of on ``X``, so most products are symmetric (half the work with the symmetric
kernels of ``pallas_kernels``) and the large ``Q X`` product happens once per restart.

References:
  Amsel, Zhang, Ahn, Naeimi, Feng, Chen, Dao, Langford, `Dion3: Full-Stack Orthogonal Updates
  <https://arxiv.org/abs/2608.11612>`_, 2026.
  Amsel, Persson, Musco, Gower, `The Polar Express <https://arxiv.org/abs/2505.16932>`_, 2025.
"""

from __future__ import annotations

from collections.abc import Sequence
import functools
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from dion3_jax import _norms, _numbers
from dion3_jax._coefficients import Coefficients, get_coefficients

Method = Literal["gram", "standard"]
Backend = Literal["auto", "xla", "mosaic", "jax_triton"]
Preconditioning = Literal["none", "norm_bound", "aol"]
_METHODS = ("gram", "standard")
_PRECONDITIONINGS = ("none", "norm_bound", "aol")
_BACKENDS = ("auto", "xla", "mosaic", "jax_triton")
_DEFAULT_COMPUTE_DTYPE = {"gram": jnp.float16, "standard": jnp.bfloat16}
#: The aspect ratio (long side over short side) from which ``method="gram"`` runs Gram
#: Newton-Schulz; closer to square it runs standard Newton-Schulz. Measured on an H200 with the
#: Mosaic products (float16, 5 steps; docs/BENCHMARKS.md, "Gram or standard Newton-Schulz per
#: shape"): standard NS 4–5% faster and more accurate at aspect 1.125 and 1.25, Gram NS 6–9%
#: faster from aspect 1.45 and more so beyond, although by FLOPs Gram NS does less work at
#: every aspect above 1.
GRAM_MIN_ASPECT = 4 / 3


def _matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """Plain batched ``a @ b`` with float32 (or float64) accumulation, output in ``a.dtype``.

    A 16-bit result is asked of XLA directly (``preferred_element_type=a.dtype``): the GEMM
    accumulates in float32 and writes the rounded result, instead of writing a float32 result
    that a separate pass converts: bitwise the same on a GPU (``tests/test_kernels_gpu.py``),
    with one pass less over the product.
    """
    if jnp.dtype(a.dtype).itemsize == 2:
        return jnp.einsum("...ik,...kj->...ij", a, b, preferred_element_type=a.dtype)
    acc = jnp.promote_types(a.dtype, jnp.float32)
    return jnp.einsum("...ik,...kj->...ij", a, b, preferred_element_type=acc).astype(a.dtype)


def _add_to_diagonal(z: jax.Array, a) -> jax.Array:
    """``z + a·I`` written into the diagonal only: in place when ``z`` has no other reader
    (an update of ``n`` elements per matrix, not a pass over all ``n²``). ``a``: a float or a
    scalar array in ``z``'s dtype."""
    i = jnp.arange(z.shape[-1])
    return z.at[..., i, i].add(jnp.asarray(a, z.dtype))


def _tall(x: jax.Array) -> bool:
    return x.shape[-2] > x.shape[-1]


def _gram(x: jax.Array, backend: Backend) -> jax.Array:
    """The Gram matrix of the short side: ``X Xᵀ`` of a wide ``x``, ``Xᵀ X`` of a tall one (read
    in place: no transposed copy)."""
    return pallas_kernels.syrk(x, transpose=_tall(x), implementation=backend)


@jax.jit
def _apply(q: jax.Array, x: jax.Array) -> jax.Array:
    """``Q X`` for a wide ``x``, ``X Q`` for a tall one (``Q``: a polynomial in :func:`_gram`)."""
    return _matmul(x, q) if _tall(x) else _matmul(q, x)


@functools.partial(jax.jit, static_argnames="backend")
def _restart(q: jax.Array, x: jax.Array, backend: Backend) -> tuple[jax.Array, jax.Array]:
    """A restart: ``X ← Q X`` and its new Gram matrix."""
    x = _apply(q, x)
    return x, _gram(x, backend)


def _gram_scales(r: jax.Array, preconditioning: Preconditioning) -> jax.Array | None:
    """Per-row scales ``d`` (``(B, n)``, float32 or wider) read off the Gram matrix ``R``
    (``(B, n, n)``) such that ``‖D R D‖₂ ≤ 1`` for ``D = diag(d)``; None for ``"none"``.

    ``"aol"``: ``dᵢ = (Σⱼ |Rᵢⱼ|)^(-1/2)``, the AOL rescaling (``‖D R D‖₂ ≤ 1`` by the Schur test);
    a zero row (padding) gets ``dᵢ = 0`` and stays zero. ``"norm_bound"``: one scale per matrix,
    ``d = min(‖R‖_∞, ‖R‖_F)^(-1/2)``, both upper bounds of ``‖R‖₂ = σ_max²``, so the iteration
    computes the same polar factor as without it, from singular values moved up towards 1 (the
    Frobenius normalization leaves ``σ_max = ‖X‖₂ / ‖X‖_F``, down to ``1/√n``). Either costs
    ``O(n²)`` per matrix, against the Gram matrix's ``O(n² m)``.

    References:
      Prach, Lampert, `Almost-Orthogonal Layers for Efficient General-Purpose Lipschitz Networks
      <https://arxiv.org/abs/2208.03160>`_, 2022 (the AOL rescaling).
    """
    if preconditioning == "none":
        return None
    r32 = r.astype(jnp.promote_types(r.dtype, jnp.float32))
    row = jnp.sum(jnp.abs(r32), axis=-1)
    if preconditioning == "aol":
        return jnp.where(row > 0, jax.lax.rsqrt(jnp.where(row > 0, row, 1.0)), 0.0)
    bound = jnp.minimum(jnp.max(row, axis=-1), jnp.sqrt(jnp.sum(r32 * r32, axis=(-2, -1))))
    d = jnp.where(bound > 0, jax.lax.rsqrt(jnp.where(bound > 0, bound, 1.0)), 0.0)
    return jnp.broadcast_to(d[:, None], row.shape)


def _scaled_gram(r: jax.Array, d: jax.Array) -> jax.Array:
    """``D R D`` in ``r``'s dtype (scaled in ``d``'s dtype, rounded once)."""
    return (r.astype(d.dtype) * d[:, :, None] * d[:, None, :]).astype(r.dtype)


def _scaled_factor(q: jax.Array, x: jax.Array, d: jax.Array) -> jax.Array:
    """The polynomial ``Q`` of ``D R D`` made to act on the unscaled ``x``: ``Q D`` for a wide
    ``x`` (``Q (D X) = (Q D) X``), ``D Q`` for a tall one (``(X D) Q = X (D Q)``); ``O(n²)``
    instead of a pass over ``x``."""
    scale = d[:, :, None] if _tall(x) else d[:, None, :]
    return (q.astype(d.dtype) * scale).astype(q.dtype)


class _StepCoefficients(NamedTuple):
    """One Newton-Schulz step's ``(a, b, c)`` as run-time operands: ``abc``, ``(a, b, c, 1)`` in
    the products' accumulation dtype (the scales of :func:`pallas_kernels.sym_matmul`; every
    scale of a step comes from it, so that its products, called with operands of one kind, share
    one traced kernel), ``diag``
    ``a`` in the compute dtype (what :func:`_add_to_diagonal` adds, rounded once from the
    Python float, as a literal would be)."""

    abc: jax.Array | np.ndarray
    diag: jax.Array | np.ndarray


def _operands(coeffs: Coefficients, dtype) -> list[_StepCoefficients]:
    """Every step's coefficients as arrays: the rows of one ``(steps, 4)`` array (NumPy: no
    device work while tracing), passed to the step bodies as operands, so that steps of one
    structure share one traced and lowered body whatever their coefficients."""
    table = np.asarray(coeffs, np.float64)
    abc = np.pad(table, ((0, 0), (0, 1)), constant_values=1.0).astype(
        jnp.promote_types(dtype, jnp.float32))
    diag = table[:, 0].astype(jnp.dtype(dtype))
    return [_StepCoefficients(abc[i], diag[i]) for i in range(len(coeffs))]


@functools.partial(jax.jit, static_argnames=("backend", "preconditioning"))
def _standard_step(x: jax.Array, k: _StepCoefficients, backend: Backend,
                   preconditioning: Preconditioning = "none") -> jax.Array:
    """One standard Newton-Schulz step: ``A = X Xᵀ; X ← (a·I + b·A + c·A²) X``; with
    ``preconditioning``, on ``D X`` (:func:`_gram_scales`: ``A ← D A D``, ``Z ← Z D``)."""
    gram = _gram(x, backend)
    d = _gram_scales(gram, preconditioning)
    if d is not None:
        gram = _scaled_gram(gram, d)
    poly = pallas_kernels.sym_matmul(gram, gram, gram, alpha=k.abc[2], beta=k.abc[1],
                                     implementation=backend)
    z = _add_to_diagonal(poly, k.diag)
    return _apply(z if d is None else _scaled_factor(z, x, d), x)


def standard_newton_schulz(x: jax.Array, coeffs: Coefficients, *, backend: Backend = "auto",
                           preconditioning: Preconditioning = "none") -> jax.Array:
    """Standard Newton-Schulz on a normalized batch ``x`` of shape ``(B, n, m)``, wide or tall.

    Per step ``(a, b, c)``, for a wide ``X``: ``A = X Xᵀ; Z = a·I + b·A + c·A²; X ← Z X`` (a tall
    one: ``A = Xᵀ X; X ← X Z``). ``Z`` is one symmetric product with ``a`` added to its diagonal,
    so the step's large product writes ``X`` in its own dtype directly (no float32 result and no
    separate ``+ a·X`` pass). Every step runs one traced body, its coefficients passed as array
    operands (the products' kernels read their scales at run time).

    Args:
      x: the batch, already divided by its norm (singular values at most 1), in the compute
        dtype the products run in.
      coeffs: the steps' ``(a, b, c)`` coefficients, e.g. from
        :func:`dion3_jax.newton_schulz.get_coefficients`.
      backend: the products' implementation (``"auto"``, ``"xla"``, ``"mosaic"``,
        ``"jax_triton"``; see ``pallas_kernels``).
      preconditioning: ``"none"``, ``"norm_bound"`` or ``"aol"``: the first step's rescaling
        read off its Gram matrix (:func:`dion3_jax.polar`).

    Returns:
      The approximate polar factor of each matrix, shaped and typed like ``x``.

    References:
      Amsel, Persson, Musco, Gower, "The Polar Express: Optimal Matrix Sign Methods and Their
      Application to the Muon Algorithm", arXiv:2505.16932 (2025).
    """
    for i, k in enumerate(_operands(coeffs, x.dtype)):
        x = _standard_step(x, k, backend, preconditioning if i == 0 else "none")
    return x


def _next_gram(r: jax.Array, z: jax.Array, a, one, backend: Backend) -> jax.Array:
    """``R``'s next value, ``Z (R Z + a·R) + a·(R Z + a·R)``: two symmetric products."""
    rz = pallas_kernels.sym_matmul(r, z, r, alpha=one, beta=a, implementation=backend)
    return pallas_kernels.sym_matmul(z, rz, rz, alpha=one, beta=a, implementation=backend)


@functools.partial(jax.jit, static_argnames=("backend", "update"))
def _gram_first(r: jax.Array, k: _StepCoefficients, backend: Backend, update: bool
                ) -> tuple[jax.Array, jax.Array]:
    """The first Gram Newton-Schulz step after a (re)start: ``Z = b·R + c·R²``, ``Q = Z + a·I``;
    with ``update``, also ``R``'s next value (:func:`_next_gram`)."""
    a, b, c, one = k.abc[0], k.abc[1], k.abc[2], k.abc[3]
    z = pallas_kernels.sym_matmul(r, r, r, alpha=c, beta=b, implementation=backend)
    if update:
        r = _next_gram(r, z, a, one, backend)
        # Z's last readers come first, so Q = Z + a·I can update Z in place.
        z, r = jax.lax.optimization_barrier((z, r))
    return r, _add_to_diagonal(z, k.diag)


@functools.partial(jax.jit, static_argnames=("backend", "update"))
def _gram_next(r: jax.Array, q: jax.Array, k: _StepCoefficients, backend: Backend, update: bool
               ) -> tuple[jax.Array, jax.Array]:
    """A later Gram Newton-Schulz step: ``Z = b·R + c·R²``, ``Q ← Q Z + a·Q``; with
    ``update``, also ``R``'s next value (:func:`_next_gram`)."""
    a, b, c, one = k.abc[0], k.abc[1], k.abc[2], k.abc[3]
    z = pallas_kernels.sym_matmul(r, r, r, alpha=c, beta=b, implementation=backend)
    q = pallas_kernels.sym_matmul(q, z, q, alpha=one, beta=a, implementation=backend)
    if update:
        r = _next_gram(r, z, a, one, backend)
    return r, q


def gram_newton_schulz(x: jax.Array, coeffs: Coefficients, restarts: Sequence[int] = (2,), *,
                       backend: Backend = "auto", preconditioning: Preconditioning = "none"
                       ) -> jax.Array:
    """Gram Newton-Schulz on a normalized batch ``x`` of shape ``(B, n, m)``, n ≠ m.

    For a wide ``X`` it iterates on ``R = X Xᵀ`` and accumulates ``Q`` (a polynomial in the Gram
    matrix) so that the result is ``Q X``; at each step in ``restarts`` it sets ``X ← Q X`` and
    recomputes ``R``, which removes the spurious negative eigenvalues that low precision leaves in
    ``R``. A tall ``X`` runs the same iteration on ``R = Xᵀ X`` with ``X Q`` (``polar(Xᵀ) =
    polar(X)ᵀ``), so no orientation needs a transposed copy. In exact arithmetic the result
    equals :func:`standard_newton_schulz`.

    Steps of one structure (the first after a (re)start or a later one; followed by another
    step of the same (re)start or not) run one traced body, their coefficients passed as array
    operands, so a 5-step iteration traces and lowers three step bodies, not five.

    Args:
      x: the batch, already divided by its norm (singular values at most 1), in the compute
        dtype the products run in; not square.
      coeffs: the steps' ``(a, b, c)`` coefficients, e.g. from
        :func:`dion3_jax.newton_schulz.get_coefficients`.
      restarts: the steps (indices into ``coeffs``) before which ``X`` is formed and ``R``
        recomputed; ``()`` never restarts.
      backend: the products' implementation (``"auto"``, ``"xla"``, ``"mosaic"``,
        ``"jax_triton"``; see ``pallas_kernels``).
      preconditioning: ``"none"``, ``"norm_bound"`` or ``"aol"``: iterate on ``D X`` with ``D``
        read off the first Gram matrix (:func:`dion3_jax.polar`); ``D`` is folded into the
        first ``Q`` (``O(n²)``), so ``X`` is never rescaled.

    Returns:
      The approximate polar factor of each matrix, shaped and typed like ``x``.

    References:
      Amsel et al., "Dion3: Full-Stack Orthogonal Updates", arXiv:2608.11612 (2026).
    """
    restart_set = set(restarts)
    last = len(coeffs) - 1
    r = _gram(x, backend)
    d = _gram_scales(r, preconditioning)
    if d is not None:
        r = _scaled_gram(r, d)
    q: jax.Array | None = None
    for i, k in enumerate(_operands(coeffs, x.dtype)):
        if i in restart_set and i != 0:
            assert q is not None   # set by step 0 (the checker cannot tell)
            if d is not None:
                q, d = _scaled_factor(q, x, d), None
            x, r = _restart(q, x, backend)
            q = None
        update = i != last and (i + 1) not in restart_set
        if q is None:
            r, q = _gram_first(r, k, backend, update)
        else:
            r, q = _gram_next(r, q, k, backend, update)
    assert q is not None
    return _apply(q if d is None else _scaled_factor(q, x, d), x)


def _padded_shape(n: int, m: int, multiples: tuple[int, int]) -> tuple[int, int]:
    """``(n, m)`` padded to the kernels' ``(tile, depth)`` multiples: the short side (the Gram
    side) to ``tile``, the long side (the contraction) to ``depth`` and at least the short
    side's padded size, so a wide or tall matrix stays so."""
    tile, depth = multiples
    if n > m:
        cols = m + -m % tile
        return max(n + -n % depth, cols), cols
    rows = n + -n % tile
    return rows, max(m + -m % depth, rows)


def _multiples(y: jax.Array | jax.ShapeDtypeStruct, backend: Backend) -> tuple[int, int] | None:
    """The kernels' ``(tile, depth)`` padding multiples for ``y``'s Gram matrix, or None (XLA)."""
    b, n, m = y.shape
    gram_operand = (b, m, n) if n > m else (b, n, m)
    return pallas_kernels.padding_multiples(gram_operand, y.dtype, backend)


def iteration_shape(shape: tuple[int, int, int], dtype, backend: Backend) -> tuple[int, int]:
    """The ``(rows, cols)`` the iteration runs on for a ``(B, n, m)`` batch in ``dtype`` (the
    compute dtype): ``(n, m)`` zero-padded to the kernels' tile multiples, ``(n, m)`` on XLA.

    A caller that writes its batch so padded (zeros past ``(n, m)``) saves the iteration's pad
    pass, and slices the factors back itself."""
    _, n, m = shape
    multiples = _multiples(jax.ShapeDtypeStruct(shape, dtype), backend)
    return (n, m) if multiples is None else _padded_shape(n, m, multiples)


def runs_gram(method: str, n: int, m: int) -> bool:
    """Whether ``method`` iterates an ``n × m`` matrix with Gram Newton-Schulz: ``"gram"`` from
    aspect ratio :data:`GRAM_MIN_ASPECT` on, standard Newton-Schulz closer to square."""
    return method == "gram" and max(n, m) >= GRAM_MIN_ASPECT * min(n, m)


def _iterate(y: jax.Array, coeffs: Coefficients, method: str, restarts: Sequence[int],
             backend: Backend, multiples: tuple[int, int] | None,
             preconditioning: Preconditioning = "none") -> jax.Array:
    """Newton-Schulz on the normalized batch ``y`` of shape ``(B, n, m)``, wide or tall.

    With ``multiples`` (the kernels' tile multiples, :func:`_multiples`), ``y`` is zero-padded
    once to them and the result sliced back, so that no product pads its operands or slices its
    result. Exact: zero rows and columns of ``X`` keep the Gram matrix, every polynomial of it
    and ``Q X`` block-diagonal, with the real block unchanged and zero rows (and columns) in
    ``Q X``.
    """
    _, n, m = y.shape
    if multiples is not None:
        rows, cols = _padded_shape(n, m, multiples)
        if (rows, cols) != (n, m):
            y = jnp.pad(y, ((0, 0), (0, rows - n), (0, cols - m)))
    if runs_gram(method, n, m):
        y = gram_newton_schulz(y, coeffs, restarts, backend=backend,
                               preconditioning=preconditioning)
    else:
        y = standard_newton_schulz(y, coeffs, backend=backend, preconditioning=preconditioning)
    return y if y.shape[1:] == (n, m) else y[:, :n, :m]


def _validate(method, restarts, backend, compute_dtype, out_dtype, eps, n_steps,
              preconditioning="none"):
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method=!r}")
    if preconditioning not in _PRECONDITIONINGS:
        raise ValueError(f"preconditioning must be one of {_PRECONDITIONINGS}, got "
                         f"{preconditioning=!r}")
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend=!r}")
    if isinstance(restarts, (str, bytes)) or not isinstance(restarts, Sequence):
        raise ValueError(f"restarts must be a sequence of step indices, got {restarts=!r}")
    for r in restarts:
        if not _numbers.is_int(r) or not 0 < r < n_steps:
            raise ValueError(
                f"restarts must hold ints in [1, {n_steps - 1}] (0-based steps of a {n_steps}-step "
                f"iteration), got {restarts=!r}")
    for name, dtype in (("compute_dtype", compute_dtype), ("out_dtype", out_dtype)):
        if dtype is not None and not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"{name} must be a floating dtype, got {name}={dtype!r}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps=!r}")


def polar(x: jax.Array, *, method: Method = "gram",
          coefficients: str | Sequence[Sequence[float]] = "polar_express",
          restarts: Sequence[int] = (2,), steps: int | None = None,
          compute_dtype: jax.typing.DTypeLike | None = None, backend: Backend = "auto",
          eps: float = 1e-7, out_dtype: jax.typing.DTypeLike | None = None,
          preconditioning: Preconditioning = "none") -> jax.Array:
    r"""Approximates the polar factor ``U Vᵀ`` of each matrix in a batch.

    The input is normalized in float32, ``X ← X / (‖X‖_F + eps)``, cast to ``compute_dtype``
    and iterated with the odd polynomials given by ``coefficients``, on the Gram matrix of its
    short side (``X Xᵀ`` of a wide matrix, ``Xᵀ X`` of a tall one; a tall input is never
    transposed). Gram Newton-Schulz is used where the long side is at least 4/3 of the short
    one; closer to square (square included) standard Newton-Schulz runs, which was measured
    faster and more accurate there on an H200.

    Args:
      x: array of shape ``(..., n, m)`` of any floating dtype; leading axes are a batch.
      method: ``"gram"`` (Gram Newton-Schulz with restarts) or ``"standard"``.
      coefficients: a preset name (``"polar_express"``, ``"polar_express_4"``, ``"you"``,
        ``"jordan"``) or a sequence of ``(a, b, c)`` triples, one per step.
      restarts: 0-based steps at which Gram Newton-Schulz restarts (ignored by ``"standard"``);
        see :func:`dion3_jax.newton_schulz.autotune_restarts`.
      steps: number of steps (default: the length of the coefficient list).
      compute_dtype: dtype of the iteration; defaults to float16 for ``"gram"`` and bfloat16 for
        ``"standard"``. Products accumulate in float32.
      backend: matmul backend for the symmetric products (``pallas_kernels``): ``"auto"``,
        ``"xla"``, ``"mosaic"`` or ``"jax_triton"``.
      eps: added to the Frobenius norm before dividing.
      out_dtype: dtype of the result; default: ``x``'s. A consumer that works in float32 anyway
        can take the result in the compute dtype (no float32 copy is written; Dion3 does this,
        which also halves the bytes its all-to-alls send back).
      preconditioning: how the first step rescales the normalized input, read off the Gram
        matrix ``R`` it forms anyway (``O(n²)`` per matrix; docs/POLAR.md): ``"none"`` (the
        Frobenius normalization alone); ``"norm_bound"``, ``X / min(‖R‖_∞, ‖R‖_F)^(1/2)``, a
        tighter bound of ``‖X‖₂`` that leaves the polar factor unchanged; ``"aol"``, ``D X``
        with ``dᵢ = (Σⱼ |Rᵢⱼ|)^(-1/2)`` (AOL), which also bounds ``‖D X‖₂`` by 1 but iterates
        towards ``polar(D X)``, not ``polar(X)``. Both start the iteration with singular values
        closer to 1, which the ``"polar_express_4"`` coefficients are fitted for.

    Returns:
      An array with the shape of ``x`` and dtype ``out_dtype`` (default: ``x``'s).

    Raises:
      ValueError: for a bad argument or an input with fewer than 2 dimensions or a non-floating
        dtype.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from dion3_jax import polar
      >>> x = jax.random.normal(jax.random.key(0), (4, 64, 256))
      >>> o = jax.jit(polar)(x)
      >>> o.shape, o.dtype
      ((4, 64, 256), dtype('float32'))
    """
    return _polar_parts([x], method=method, coefficients=coefficients, restarts=restarts,
                        steps=steps, compute_dtype=compute_dtype, backend=backend, eps=eps,
                        out_dtype=out_dtype, preconditioning=preconditioning)


def resolved_compute_dtype(method: str, compute_dtype=None):
    """The dtype :func:`polar` iterates in: ``compute_dtype``, or the method's default."""
    if compute_dtype is not None:
        return compute_dtype            # validated by polar
    return _DEFAULT_COMPUTE_DTYPE.get(method)


def _normalized(x: jax.Array, eps: float, compute_dtype, norm=None) -> jax.Array:
    """``(B, n, m)`` → ``X / (‖X‖_F + eps)`` per matrix, normalized in float32 (at least), cast to
    ``compute_dtype``. ``norm``: ``‖X‖_F`` per matrix, ``(B,)``, when the caller has it already
    (else computed from ``x``, overflow-safe)."""
    y = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    if norm is None:
        norm = _norms.norm(y, axis=(-2, -1), keepdims=True)
    else:
        norm = norm.astype(y.dtype)[:, None, None]
    return (y / (norm + eps)).astype(compute_dtype)


def _polar_normalized(y: jax.Array, *, method, coefficients, restarts, steps, compute_dtype,
                      backend, eps, out_dtype=None, preconditioning="none") -> jax.Array:
    """:func:`polar` of a batch ``y`` of shape ``(B, n, m)`` that the caller has already divided
    by its norms (plus ``eps``) and cast to the compute dtype: the iteration only, with no pass
    over ``y`` first (Dion3's payloads arrive so)."""
    coeffs = get_coefficients(coefficients, steps)
    _validate(method, restarts, backend, compute_dtype, out_dtype, eps, len(coeffs),
              preconditioning)
    out_dtype = y.dtype if out_dtype is None else out_dtype
    y = y.astype(resolved_compute_dtype(method, compute_dtype))
    if y.size == 0:
        return y.astype(out_dtype)
    return _iterate(y, coeffs, method, restarts, backend, _multiples(y, backend),
                    preconditioning).astype(out_dtype)


def _polar_parts(parts: Sequence[jax.Array], *, method, coefficients, restarts, steps,
                 compute_dtype, backend, eps, out_dtype=None, norms=None,
                 preconditioning="none") -> jax.Array:
    """:func:`polar` of ``concatenate(parts)`` (same trailing shape and dtype; leading axes are
    a batch), with each part normalized and cast on its own before the concatenation: the batch
    is assembled once, in the compute dtype (half the bytes of a float32 stack for float16).
    ``norms``: None, or per part None or the Frobenius norm of each of its matrices
    (shape: the part's batch shape)."""
    coeffs = get_coefficients(coefficients, steps)
    _validate(method, restarts, backend, compute_dtype, out_dtype, eps, len(coeffs),
              preconditioning)
    parts = [jnp.asarray(x) for x in parts]
    x = parts[0]
    if x.ndim < 2:
        raise ValueError(f"polar needs an input with at least 2 dimensions, got {x.shape=}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"polar needs a floating input, got {x.dtype=}")
    n, m = x.shape[-2:]
    for p in parts[1:]:
        if p.shape[-2:] != (n, m) or p.dtype != x.dtype:
            raise ValueError(f"parts must share their matrix shape and dtype, got "
                             f"{x.shape[-2:]}/{x.dtype} and {p.shape[-2:]}/{p.dtype}")
    compute_dtype = resolved_compute_dtype(method, compute_dtype)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    batch = [p.shape[:-2] for p in parts]
    if sum(p.size for p in parts) == 0:
        y = jnp.concatenate([p.reshape((-1, n, m)) for p in parts]) if len(parts) > 1 else x
        return y.astype(out_dtype)
    if norms is None:
        norms = [None] * len(parts)
    if len(norms) != len(parts):
        raise ValueError(f"norms needs one entry per part: {len(norms)} for "
                         f"{len(parts)} parts")
    for p, q in zip(parts, norms):
        if q is not None and jnp.shape(q) != p.shape[:-2]:
            raise ValueError(f"norms: a part of shape {p.shape} needs norms of shape "
                             f"{p.shape[:-2]}, got {jnp.shape(q)}")
    ys = [_normalized(p.reshape((-1, n, m)), eps, compute_dtype,
                      None if q is None else jnp.reshape(q, (-1,)))
          for p, q in zip(parts, norms)]
    y = ys[0] if len(ys) == 1 else jnp.concatenate(ys, axis=0)
    y = _iterate(y, coeffs, method, restarts, backend, _multiples(y, backend),
                 preconditioning).astype(out_dtype)
    return y.reshape((*batch[0], n, m)) if len(parts) == 1 else y
