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
"""Restart autotune for Gram Newton-Schulz.

Gram Newton-Schulz never forms the iterate ``X``: it accumulates ``Q`` (a polynomial of the Gram
matrix ``R = X Xᵀ``) and applies it once, as ``Q X``. Per step ``(a, b, c)`` and per eigenvalue
``λ`` of ``R`` (``λ = σ²`` for a singular value ``σ`` of ``X``)::

    h = a + b·λ + c·λ²      q ← q·h      λ ← λ·h²

where ``q`` is the matching eigenvalue of ``Q``. In exact arithmetic ``λ ≥ 0``; in float16 the
computed ``R`` carries spurious eigenvalues down to about ``-4e-4`` (relative to a normalized
input). For ``λ < 0`` and ``b < 0`` the factor ``h`` exceeds ``a``, ``|λ|`` grows with ``h²`` at
every step, and ``q`` blows up along directions that hold only rounding noise. A *restart* at
step ``i`` (``i ≠ 0``) applies the accumulated ``Q`` (``X ← Q X``), recomputes ``R ← X Xᵀ`` and
resets ``Q ← I``, so spurious eigenvalues fall back to the ``-4e-4`` level. Each restart costs one
``Q X`` product and one Gram product, so we want as few as possible.

The model and the criterion follow the reference autotune of Dao-AILab/gram-newton-schulz
(``restart_autotune.py``); this is an independent implementation:

* singular values ``σ`` on a log grid over ``[1e-10, 1]`` (10 000 points); every Gram eigenvalue
  is shifted by the spurious eigenvalue ``p``: ``λ = σ² + p``, so the smallest ``σ`` stand for
  directions whose computed eigenvalue is ``p < 0``. The shift is re-applied after every restart
  (a freshly rounded Gram matrix has fresh rounding errors);
* the scalar recursion above runs in float64;
* the *growth* of a restart set is the worst, over steps, condition number of ``Q`` over the
  grid: ``max_step max_σ |q| / min_σ |q|``.

The reference searches exhaustively over sets of a user-given size (default one restart) and
keeps the smallest growth. :func:`autotune_restarts` instead takes the fewest restarts whose
growth is at most ``max_growth`` (ties: the smallest growth, then the earliest positions). With
the defaults it picks ``(2,)`` for ``"polar_express"`` and ``"you"`` (growth 84.6 and 53.2, the
values the reference reports, and the reference default ``restarts=(2,)``) and ``(3,)`` for
``"jordan"`` (62.5; ``(2,)`` gives 74.1).

References:
  `Dion3: Full-Stack Orthogonal Updates <https://arxiv.org/abs/2608.11612>`_, 2026, §B.2
  (spurious negative Gram eigenvalues in float16).
  Dao-AILab, `gram-newton-schulz <https://github.com/Dao-AILab/gram-newton-schulz>`_
  (``restart_autotune.py``: the model and the condition-number criterion).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence
import itertools
import json
import math
import os
import sys
from typing import NamedTuple

import numpy as np

from dion3_jax._coefficients import Coefficients, PRESETS, get_coefficients

DEFAULT_SPURIOUS_EIGENVALUE = -4e-4
"""Most negative spurious Gram eigenvalue seen in float16 (Dion3 paper, §B.2)."""

DEFAULT_MAX_GROWTH = 2.0**11
"""Largest accepted condition number of ``Q``: ``1 / u`` for the float16 unit roundoff ``u``."""

_DEFAULT_NUM_POINTS = 10_000


def _default_singular_values() -> np.ndarray:
    return np.logspace(0.0, -10.0, _DEFAULT_NUM_POINTS)


class GramTrace(NamedTuple):
    """Per-eigen-direction trace of the scalar Gram Newton-Schulz recursion."""

    q: np.ndarray  # shape=(steps, points), float64: eigenvalue of Q after each step.
    x: np.ndarray  # shape=(steps, points), float64: singular value of the X that step's Q scales.


def _check_spurious(spurious_eigenvalue: float) -> float:
    try:
        p = float(spurious_eigenvalue)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"spurious_eigenvalue must be a float, got {spurious_eigenvalue=!r}") from e
    if not math.isfinite(p) or p > 0:
        raise ValueError(
            f"spurious_eigenvalue must be finite and <= 0 (a spurious negative Gram eigenvalue; 0 "
            f"models exact arithmetic), got {spurious_eigenvalue=!r}")
    return p


def _check_restarts(restarts: Iterable[int], steps: int) -> tuple[int, ...]:
    try:
        items = tuple(restarts)
    except TypeError as e:
        raise ValueError(f"restarts must be a sequence of ints, got {restarts=!r}") from e
    for i in items:
        if not isinstance(i, (int, np.integer)) or isinstance(i, (bool, np.bool_)):
            raise ValueError(f"restarts must hold ints, got {restarts=!r}")
        if not 1 <= i < steps:
            raise ValueError(
                f"restart indices must lie in [1, {steps - 1}] (0-based steps; a restart at step 0 "
                f"is meaningless and one at step >= {steps=} never happens), got {restarts=!r}")
    if len(set(items)) != len(items):
        raise ValueError(f"restarts must not repeat an index, got {restarts=!r}")
    return tuple(sorted(int(i) for i in items))


def _check_singular_values(singular_values) -> np.ndarray:
    if singular_values is None:
        return _default_singular_values()
    x = np.asarray(singular_values, dtype=np.float64)
    if x.ndim != 1 or x.size == 0 or not np.all(np.isfinite(x)) or np.any(x < 0):
        raise ValueError(
            f"singular_values must be a non-empty 1-D array of finite values >= 0, got "
            f"{np.shape(singular_values)=}")
    return x


def simulate_gram_eigenvalues(
    coefficients: str | Sequence[Sequence[float]] = "polar_express",
    restarts: Iterable[int] = (),
    *,
    steps: int | None = None,
    spurious_eigenvalue: float = DEFAULT_SPURIOUS_EIGENVALUE,
    singular_values=None,
) -> GramTrace:
    """Runs the scalar Gram Newton-Schulz recursion, one eigen-direction per singular value.

    Every matrix in Gram Newton-Schulz is a polynomial of the same Gram matrix, so the iteration
    decouples along its eigenvectors. For a singular value ``σ`` of the normalized input the
    Gram eigenvalue starts at ``λ = σ² + p`` (``p = spurious_eigenvalue``); step ``(a, b, c)``
    computes ``h = a + b·λ + c·λ²``, ``q ← q·h``, ``λ ← λ·h²``. A restart at step ``i`` first sets
    ``σ ← q·σ`` (``X ← Q X``), ``λ ← σ² + p`` (a fresh, freshly perturbed Gram matrix) and
    ``q ← 1``. The computation is float64, with no rounding model beyond ``p``.

    Args:
      coefficients: a preset name or a sequence of ``(a, b, c)`` triples (see
        :func:`dion3_jax._coefficients.get_coefficients`).
      restarts: 0-based step indices in ``[1, steps - 1]`` at which to restart.
      steps: optional number of steps; presets are truncated or padded with their last triple.
      spurious_eigenvalue: the shift ``p <= 0`` applied to every Gram eigenvalue; ``0`` gives the
        exact-arithmetic iteration.
      singular_values: 1-D array of singular values ``σ >= 0`` of the normalized input; default
        ``numpy.logspace(0, -10, 10000)``.

    Returns:
      A :class:`GramTrace`: ``q[i]`` holds Q's eigenvalues after step ``i`` and ``x[i]`` the
      singular values of the ``X`` they multiply, so the output's singular values are
      ``q[-1] * x[-1]``. Values that overflow come out as ``inf`` or ``nan``.

    Raises:
      ValueError: on bad coefficients or ``steps``, a restart index outside ``[1, steps - 1]`` or
        repeated, a positive or non-finite ``spurious_eigenvalue``, or malformed
        ``singular_values``.
    """
    coeffs = get_coefficients(coefficients, steps)
    restart_set = set(_check_restarts(restarts, len(coeffs)))
    p = _check_spurious(spurious_eigenvalue)
    x = _check_singular_values(singular_values).copy()
    qs, xs = [], []
    q = np.ones_like(x)
    lam = x * x + p
    with np.errstate(over="ignore", invalid="ignore"):
        for i, (a, b, c) in enumerate(coeffs):
            if i in restart_set:
                x = q * x
                lam = x * x + p
                q = np.ones_like(x)
            h = a + lam * (b + lam * c)
            q = q * h
            lam = lam * h * h
            qs.append(q)
            xs.append(x)
    return GramTrace(q=np.stack(qs), x=np.stack(xs))


def _growth_of_trace(q: np.ndarray) -> float:
    aq = np.abs(q)
    if not np.all(np.isfinite(aq)):
        return math.inf
    lo = aq.min(axis=1)
    if np.any(lo == 0):
        return math.inf
    return float(np.max(aq.max(axis=1) / lo))


def restart_growth(
    coefficients: str | Sequence[Sequence[float]] = "polar_express",
    restarts: Iterable[int] = (),
    *,
    steps: int | None = None,
    spurious_eigenvalue: float = DEFAULT_SPURIOUS_EIGENVALUE,
    singular_values=None,
) -> float:
    """Worst condition number of Gram Newton-Schulz's ``Q`` under spurious Gram eigenvalues.

    Runs :func:`simulate_gram_eigenvalues` and returns ``max_i max|q_i| / min|q_i|``, the worst
    over steps ``i`` of the spread of Q's eigenvalues over the singular-value grid. Large values
    mean ``Q`` amplifies directions that hold only rounding noise relative to genuine ones (the
    criterion of the Dao-AILab/gram-newton-schulz restart autotune).

    Args:
      coefficients: a preset name or a sequence of ``(a, b, c)`` triples.
      restarts: 0-based step indices in ``[1, steps - 1]`` at which to restart; ``()`` for none.
      steps: optional number of steps; presets are truncated or padded with their last triple.
      spurious_eigenvalue: the most negative spurious Gram eigenvalue (``<= 0``); default
        ``-4e-4``, the float16 level measured in the Dion3 paper, §B.2.
      singular_values: 1-D grid of singular values; default ``numpy.logspace(0, -10, 10000)``.

    Returns:
      The growth, ``>= 1``; ``inf`` when the recursion overflows or ``Q`` gets a zero
      eigenvalue.

    Raises:
      ValueError: on any argument :func:`simulate_gram_eigenvalues` rejects.

    References:
      `Dion3: Full-Stack Orthogonal Updates <https://arxiv.org/abs/2608.11612>`_, 2026, §B.2.
    """
    trace = simulate_gram_eigenvalues(
        coefficients, restarts, steps=steps, spurious_eigenvalue=spurious_eigenvalue,
        singular_values=singular_values)
    return _growth_of_trace(trace.q)


def restart_candidates(
    coefficients: str | Sequence[Sequence[float]] = "polar_express",
    num_restarts: int = 1,
    *,
    steps: int | None = None,
    spurious_eigenvalue: float = DEFAULT_SPURIOUS_EIGENVALUE,
    singular_values=None,
) -> list[tuple[tuple[int, ...], float]]:
    """Growth of every restart set of a given size, best first.

    Args:
      coefficients: a preset name or a sequence of ``(a, b, c)`` triples.
      num_restarts: the number of restarts, in ``[0, steps - 1]``.
      steps: optional number of steps; presets are truncated or padded with their last triple.
      spurious_eigenvalue: the most negative spurious Gram eigenvalue (``<= 0``).
      singular_values: 1-D grid of singular values; default ``numpy.logspace(0, -10, 10000)``.

    Returns:
      ``(restarts, growth)`` pairs for all ``C(steps - 1, num_restarts)`` sets, sorted by growth,
      then by position (earliest first).

    Raises:
      ValueError: on a ``num_restarts`` that is not an int in ``[0, steps - 1]``, or on any
        argument :func:`restart_growth` rejects.
    """
    coeffs = get_coefficients(coefficients, steps)
    n = len(coeffs)
    if (not isinstance(num_restarts, (int, np.integer)) or isinstance(num_restarts, bool)
            or not 0 <= num_restarts <= n - 1):
        raise ValueError(
            f"num_restarts must be an int in [0, {n - 1}] for {n} steps, got {num_restarts=!r}")
    p = _check_spurious(spurious_eigenvalue)
    x = _check_singular_values(singular_values)
    rows = [
        (combo, restart_growth(coeffs, combo, spurious_eigenvalue=p, singular_values=x))
        for combo in itertools.combinations(range(1, n), int(num_restarts))
    ]
    return sorted(rows, key=lambda row: (row[1], row[0]))


def autotune_restarts(
    coefficients: str | Sequence[Sequence[float]] = "polar_express",
    *,
    steps: int | None = None,
    spurious_eigenvalue: float = DEFAULT_SPURIOUS_EIGENVALUE,
    max_growth: float = DEFAULT_MAX_GROWTH,
    max_restarts: int | None = None,
    num_restarts: int | None = None,
    singular_values=None,
) -> tuple[int, ...]:
    """Chooses Gram Newton-Schulz restart positions for a coefficient list.

    Among all restart sets, takes those with the fewest restarts whose growth
    (:func:`restart_growth`: the worst condition number of ``Q`` when every Gram eigenvalue is
    shifted by ``spurious_eigenvalue``) is at most ``max_growth``, and returns the one with the
    smallest growth (ties: the earliest positions). Sizes are tried in increasing order and the
    search is exhaustive within a size.

    The default bound ``max_growth = 2**11 = 2048`` is ``1 / u`` for the float16 unit roundoff
    ``u = 2**-11``: rounding ``Q`` to float16 perturbs its eigenvalues by about ``u·‖Q‖``, which
    stays below its smallest eigenvalue ``‖Q‖ / cond(Q)`` only while ``cond(Q) <= 1 / u``. The
    exact-arithmetic iterations (``spurious_eigenvalue=0``) of the presets stay below it without
    any restart (growth 903 for ``"polar_express"``, 504 for ``"you"``, 696 for ``"jordan"``, of
    the order of ``∏ a``), so the bound only rejects growth caused by spurious eigenvalues.
    With the defaults the result is ``(2,)`` for ``"polar_express"`` (no restart: growth
    2.7e12; ``(2,)``: 84.6), the reference default ``restarts=(2,)``; ``(2,)`` for ``"you"``
    and ``(3,)`` for ``"jordan"``; ``()`` for ``"polar_express_4"`` (growth 612; 7174 at a
    spurious eigenvalue of ``-1e-3``, so with less margin than the others).

    Args:
      coefficients: a preset name or a sequence of ``(a, b, c)`` triples.
      steps: optional number of steps; presets are truncated or padded with their last triple.
      spurious_eigenvalue: the most negative spurious Gram eigenvalue (``<= 0``); default
        ``-4e-4``, the float16 level of the Dion3 paper, §B.2.
      max_growth: the largest accepted growth, ``>= 1``; default ``2048`` (see above).
      max_restarts: the most restarts to try; default ``steps - 1`` (all positions). Values
        above ``steps - 1`` are clamped.
      num_restarts: if given, use exactly this many restarts (the reference autotune's mode,
        which keeps the smallest growth of that size); ``max_restarts`` is then ignored. The
        bound still applies.
      singular_values: 1-D grid of singular values; default ``numpy.logspace(0, -10, 10000)``.

    Returns:
      The sorted 0-based restart positions, e.g. ``(2,)``; ``()`` if no restart is needed.

    Raises:
      ValueError: on bad arguments (each names the argument), or if no set within
        ``max_restarts`` (or of size ``num_restarts``) meets ``max_growth``.

    Examples:
      >>> autotune_restarts("polar_express")
      (2,)

    References:
      `Dion3: Full-Stack Orthogonal Updates <https://arxiv.org/abs/2608.11612>`_, 2026, §B.2.
    """
    coeffs = get_coefficients(coefficients, steps)
    n = len(coeffs)
    p = _check_spurious(spurious_eigenvalue)
    x = _check_singular_values(singular_values)
    try:
        bound = float(max_growth)
    except (TypeError, ValueError) as e:
        raise ValueError(f"max_growth must be a float >= 1, got {max_growth=!r}") from e
    if not math.isfinite(bound) or bound < 1:
        raise ValueError(f"max_growth must be finite and >= 1 (a condition number), got "
                         f"{max_growth=!r}")
    sizes: Sequence[int]
    if num_restarts is not None:
        sizes = [num_restarts]  # restart_candidates validates it.
    else:
        if max_restarts is None:
            top = n - 1
        elif (not isinstance(max_restarts, (int, np.integer)) or isinstance(max_restarts, bool)
              or max_restarts < 0):
            raise ValueError(f"max_restarts must be a non-negative int or None, got "
                             f"{max_restarts=!r}")
        else:
            top = min(int(max_restarts), n - 1)
        sizes = range(top + 1)
    best = math.inf
    for k in sizes:
        rows = restart_candidates(coeffs, k, spurious_eigenvalue=p, singular_values=x)
        combo, growth = rows[0]
        if growth <= bound:
            return combo
        best = min(best, growth)
    raise ValueError(
        f"no restart set of size {list(sizes)} keeps the growth within {max_growth=} for {n} "
        f"steps (best growth {best:.4g}); allow more restarts ({max_restarts=}, "
        f"{num_restarts=}), raise max_growth or use fewer steps")


# ----------------------------------------------------------------------------------------------
# Command line.


def _parse_coefficients(text: str) -> str | Coefficients:
    """Preset name, JSON file, JSON string ``[[a, b, c], ...]`` or ``"a,b,c;a,b,c"``."""
    if text in PRESETS:
        return text
    if os.path.isfile(text):
        with open(text) as f:
            text = f.read()
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        try:
            value = [[float(v) for v in row.split(",")] for row in text.strip().split(";") if row]
        except ValueError:
            raise ValueError(
                f"--coefficients must be a preset ({', '.join(sorted(PRESETS))}), a JSON file, a "
                f"JSON list of [a, b, c] triples or 'a,b,c;a,b,c;...', got {text!r}") from None
    return get_coefficients(value)


def _format_restarts(combo: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, combo)) + ("," if len(combo) == 1 else "") + ")"


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m dion3_jax.newton_schulz --coefficients polar_express``.

    Prints, for each number of restarts up to the chosen one, the best candidate sets with their
    growth, then the chosen set. Returns the exit status (0; 1 if no set meets the bound).
    """
    parser = argparse.ArgumentParser(
        prog="python -m dion3_jax.newton_schulz",
        description="Choose Gram Newton-Schulz restart positions by bounding the condition number "
                    "of Q when the float16 Gram matrix has spurious negative eigenvalues.")
    parser.add_argument(
        "--coefficients", default="polar_express",
        help=f"preset ({', '.join(sorted(PRESETS))}), a JSON file or JSON string holding a list "
             f"of [a, b, c] triples, or 'a,b,c;a,b,c;...' (default: polar_express)")
    parser.add_argument("--steps", type=int, default=None,
                        help="number of steps (truncates or pads with the last triple)")
    parser.add_argument("--spurious", type=float, default=DEFAULT_SPURIOUS_EIGENVALUE,
                        help="most negative spurious Gram eigenvalue (default: -4e-4)")
    parser.add_argument("--max-growth", type=float, default=DEFAULT_MAX_GROWTH,
                        help="largest accepted condition number of Q (default: 2048 = 1/u_fp16)")
    parser.add_argument("--max-restarts", type=int, default=None,
                        help="most restarts to consider (default: steps - 1)")
    parser.add_argument("--num-restarts", type=int, default=None,
                        help="use exactly this many restarts (reference autotune mode)")
    parser.add_argument("--top", type=int, default=5,
                        help="candidate sets shown per number of restarts (default: 5)")
    args = parser.parse_args(argv)

    try:
        coeffs = _parse_coefficients(args.coefficients)
        coeffs = get_coefficients(coeffs, args.steps)
        kwargs = dict(spurious_eigenvalue=args.spurious)
        chosen, error = None, None
        try:
            chosen = autotune_restarts(coeffs, max_growth=args.max_growth,
                                       max_restarts=args.max_restarts,
                                       num_restarts=args.num_restarts, **kwargs)
        except ValueError as e:
            error = e
        n = len(coeffs)
        if chosen is not None:
            sizes = [len(chosen)] if args.num_restarts is not None else range(len(chosen) + 1)
        elif args.num_restarts is not None:
            sizes = [args.num_restarts]
        else:
            top = n - 1 if args.max_restarts is None else min(args.max_restarts, n - 1)
            sizes = range(max(top, 0) + 1)
        tables = [(k, restart_candidates(coeffs, k, **kwargs)) for k in sizes]
    except ValueError as e:
        parser.error(str(e))

    name = args.coefficients if args.coefficients in PRESETS else "custom"
    print(f"Gram Newton-Schulz restart autotune: coefficients={name}, steps={n}, "
          f"spurious eigenvalue={args.spurious:g}, max growth={args.max_growth:g}")
    print(f"{'restarts':<20} {'growth (cond Q)':>16}  within bound")
    for k, rows in tables:
        shown = rows[:max(args.top, 1)]
        for combo, growth in shown:
            ok = "yes" if growth <= args.max_growth else "no"
            print(f"{_format_restarts(combo):<20} {growth:>16.4g}  {ok}")
        if len(rows) > len(shown):
            print(f"  ... {len(rows) - len(shown)} more set(s) with {k} restart(s)")
    if chosen is None:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"chosen restarts: {_format_restarts(chosen)}")
    return 0
