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


def _apply_safety(coeffs: Coefficients, s: float) -> Coefficients:
    # p(x/s)·... : a/s, b/s³, c/s⁵ keeps every step's output inside the converged band when the
    # input norm is slightly overestimated.
    return tuple((a / s, b / s**3, c / s**5) for a, b, c in coeffs)


PRESETS: dict[str, Coefficients] = {
    "polar_express": _apply_safety(_POLAR_EXPRESS_RAW, POLAR_EXPRESS_SAFETY),
    "you": (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
    "jordan": ((3.4445, -4.7750, 2.0315),) * 5,
}


def get_coefficients(coefficients: str | Sequence[Sequence[float]], steps: int | None = None
                     ) -> Coefficients:
    """Resolves a preset name or a user sequence into a tuple of ``(a, b, c)`` triples.

    Args:
      coefficients: a preset name (``"polar_express"``, ``"you"``, ``"jordan"``) or a sequence
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
