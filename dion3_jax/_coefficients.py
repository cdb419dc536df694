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
"""Newton-Schulz coefficient presets.

Each preset is a sequence of ``(a, b, c)`` triples, one per step, for the odd polynomial
``p(x) = a·x + b·x³ + c·x⁵`` applied to the singular values of the normalized input.

References:
  Amsel, Persson, Musco, Gower, `The Polar Express: Optimal Matrix Sign Methods and Their
  Application to the Muon Algorithm <https://arxiv.org/abs/2505.16932>`_, 2025.
  Jordan et al., `Muon: An optimizer for hidden layers in neural networks
  <https://kellerjordan.github.io/posts/muon/>`_, 2024.
"""

from __future__ import annotations

from collections.abc import Sequence
import math

import numpy as np

from dion3_jax import _numbers

Coefficients = tuple[tuple[float, float, float], ...]

# Raw Polar Express coefficients (5 steps).
_POLAR_EXPRESS_RAW: Coefficients = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
)
POLAR_EXPRESS_SAFETY = 1.05
#: The cushion of the Polar Express recipe: each step is fitted on ``[max(ℓ, cushion·u), u]``.
POLAR_EXPRESS_CUSHION = 0.02407327424182761

# 4 steps fitted by :func:`polar_express_coefficients` for singular values in [0.01, 1] (the
# Frobenius-normalized Gaussian inputs of the benchmark shapes have σ_min ≥ 0.02·σ_max-ish and,
# with ``preconditioning="norm_bound"``, σ_max ≥ 0.3; tests/test_polar.py checks the fit).
_POLAR_EXPRESS_4_RAW: Coefficients = (
    (7.98936321422251, -22.74783212374479, 16.678598023544318),
    (3.6434181477950847, -2.7268652746987305, 0.5371078953570534),
    (2.671266479960076, -1.9853154429743884, 0.4535225171407155),
    (1.9588931234180307, -1.340357422394006, 0.38414421998328496),
)
POLAR_EXPRESS_4_LOWER = 0.01


def _apply_safety(coeffs: Coefficients, s: float) -> Coefficients:
    # p(x/s)·... : a/s, b/s³, c/s⁵ keeps every step's output inside the converged band when the
    # input norm is slightly overestimated.
    return tuple((a / s, b / s**3, c / s**5) for a, b, c in coeffs)


PRESETS: dict[str, Coefficients] = {
    "polar_express": _apply_safety(_POLAR_EXPRESS_RAW, POLAR_EXPRESS_SAFETY),
    "polar_express_4": _apply_safety(_POLAR_EXPRESS_4_RAW, POLAR_EXPRESS_SAFETY),
    "you": (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
    "jordan": ((3.4445, -4.7750, 2.0315),) * 5,
}


def _minimax_quintic(lo: float, hi: float) -> tuple[float, float, float]:
    """The odd quintic ``p(x) = a·x + b·x³ + c·x⁵`` that minimizes ``max |1 − p(x)|`` on
    ``[lo, hi]``: Remez exchange on its four alternation points (``lo``, ``hi`` and the two
    interior extrema of ``p``), in float64."""
    if lo >= hi * (1 - 5e-6):            # a point: the Newton-Schulz quintic scaled to hi
        return 15 / 8 / hi, -10 / 8 / hi**3, 3 / 8 / hi**5
    q, r = (3 * lo + hi) / 4, (lo + 3 * hi) / 4
    previous = math.inf
    for _ in range(100):
        x = np.array([lo, q, r, hi])
        a, b, c, err = np.linalg.solve(np.stack([x, x**3, x**5, [1.0, -1.0, 1.0, -1.0]], 1),
                                       np.ones(4))
        # p'(x) = a + 3b·x² + 5c·x⁴ = 0 at the new interior extrema.
        root = math.sqrt(9 * b * b - 20 * a * c)
        q, r = math.sqrt((-3 * b - root) / (10 * c)), math.sqrt((-3 * b + root) / (10 * c))
        if abs(previous - err) < 1e-15:
            break
        previous = err
    return float(a), float(b), float(c)


def polar_express_coefficients(lower: float, steps: int, *, cushion: float = POLAR_EXPRESS_CUSHION,
                               safety: float = POLAR_EXPRESS_SAFETY) -> Coefficients:
    """Polar Express coefficients for singular values in ``[lower, 1]``, ``steps`` steps.

    The greedy recipe of the paper (its Algorithm 1): each step is the minimax odd quintic for
    the current interval ``[ℓ, u]`` (fitted on ``[max(ℓ, cushion·u), u]``, then rescaled so that
    ``p(ℓ)`` and ``p(u)`` lie symmetrically about 1); the next interval is ``[p(ℓ), 2 − p(ℓ)]``.
    Then every step is divided by ``safety`` (``a/s, b/s³, c/s⁵``). With ``lower=1e-3`` and 5
    steps this gives the ``"polar_express"`` preset; with ``lower=0.01`` and 4 steps,
    ``"polar_express_4"``.

    Args:
      lower: the smallest singular value to converge, in ``(0, 1)``.
      steps: the number of steps, ``>= 1``.
      cushion: the smallest interval ratio a step is fitted on (the paper's 0.024).
      safety: the safety factor (1.05).

    Returns:
      A tuple of ``(a, b, c)`` triples, one per step.

    Raises:
      ValueError: for ``lower`` outside ``(0, 1)``, ``steps < 1``, a ``cushion`` outside
        ``[0, 1)`` or ``safety < 1``.

    References:
      Amsel, Persson, Musco, Gower, `The Polar Express <https://arxiv.org/abs/2505.16932>`_,
      2025, Algorithm 1.
    """
    if not 0 < lower < 1:
        raise ValueError(f"lower must lie in (0, 1), got {lower=!r}")
    if not _numbers.is_int(steps) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps=!r}")
    if not 0 <= cushion < 1:
        raise ValueError(f"cushion must lie in [0, 1), got {cushion=!r}")
    if not safety >= 1:
        raise ValueError(f"safety must be >= 1, got {safety=!r}")
    lo, hi, raw = float(lower), 1.0, []
    for _ in range(steps):
        a, b, c = _minimax_quintic(max(lo, cushion * hi), hi)
        p_lo, p_hi = (a * v + b * v**3 + c * v**5 for v in (lo, hi))
        a, b, c = (2 / (p_lo + p_hi) * v for v in (a, b, c))
        raw.append((a, b, c))
        lo = a * lo + b * lo**3 + c * lo**5
        hi = 2 - lo
    return _apply_safety(tuple(raw), safety)


def get_coefficients(coefficients: str | Sequence[Sequence[float]], steps: int | None = None
                     ) -> Coefficients:
    """Resolves a preset name or a user sequence into a tuple of ``(a, b, c)`` triples.

    Args:
      coefficients: a preset name (``"polar_express"``, ``"polar_express_4"``, ``"you"``,
        ``"jordan"``) or a sequence
        of ``(a, b, c)`` triples, one per step.
      steps: optional number of steps. A preset shorter than ``steps`` repeats its last triple;
        a longer one is truncated to its first ``steps`` triples.

    Returns:
      A tuple of float triples.

    Raises:
      ValueError: on an unknown preset name, a malformed sequence, non-finite values or a
        non-positive ``steps``.
    """
    if isinstance(coefficients, str):
        if coefficients not in PRESETS:
            raise ValueError(
                f"Unknown coefficient preset {coefficients=!r}; known: {sorted(PRESETS)}")
        coeffs = PRESETS[coefficients]
    else:
        try:
            raw = [tuple(float(v) for v in t) for t in coefficients]
        except TypeError as e:
            raise ValueError(
                f"coefficients must be a preset name or a sequence of (a, b, c) triples, got "
                f"{coefficients=!r}") from e
        if not raw or any(len(t) != 3 for t in raw):
            raise ValueError(
                f"coefficients must be a non-empty sequence of (a, b, c) triples, got "
                f"{coefficients=!r}")
        coeffs = tuple((a, b, c) for a, b, c in raw)
        if not all(math.isfinite(v) for t in coeffs for v in t):
            raise ValueError(f"coefficients must be finite, got {coefficients=!r}")
    if steps is not None:
        if not _numbers.is_int(steps) or steps < 1:
            raise ValueError(f"steps must be a positive int, got {steps=!r}")
        if steps <= len(coeffs):
            coeffs = coeffs[:steps]
        else:
            coeffs = coeffs + (coeffs[-1],) * (steps - len(coeffs))
    return coeffs
