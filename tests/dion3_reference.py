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
"""A float64 NumPy rendering of the Dion3 update rule, written independently of the package.

Loops over matrices, explicit row indices, no shared helpers: the tests compare the package's
update with this one.

Matrices here are in the (out × in) view: row i = output neuron i. One step on an ``n × C``
matrix ``W`` with gradient ``G``, momentum ``M`` (``n × C``) and NorMuon second moments ``v``
(length ``n``), for fraction ``f``, decay ``mu``, EMA coefficient ``beta2``, learning rate ``lr``
and weight decay ``wd`` (the numbers match the comments in :func:`dion3_matrix_step`):

1. Accumulate: ``M ← M + G``.
2. Score every row by its ℓ1 norm: ``s_i = Σ_j |M_ij|``.
3. Select ``k = max(1, ⌈f·n⌉)`` rows ``I``: the ``k`` largest scores, ties to the lower index.
4. Take the payload ``S = M[I, :]``.
5. Error feedback: ``M[I, :] ← mu·S``; the unselected rows keep their full momentum.
6. Orthogonalize: ``O = polar(S)``, five Newton-Schulz steps on ``S / (‖S‖_F + 1e-7)`` with
   the Polar Express coefficients under the 1.05 safety factor (``a/1.05, b/1.05³, c/1.05⁵``;
   :func:`ns_polar`).
7. NorMuon (``flavor="normuon"``): ``ν_i = mean_j O_ij²``, ``v[I] ← beta2·v[I] + (1 − beta2)·ν``,
   ``D = O / (√v[I] + 1e-8)`` rescaled so that ``‖D‖_F = ‖O‖_F``. Muon: ``D = O``.
8. Shape factor from the whole matrix: ``η = lr·√(n/C)`` (``"spectral_norm"``),
   ``lr·0.2·√max(n, C)`` (``"rms_norm"``) or ``lr`` (``None``).
9. Decoupled weight decay on every entry: ``W ← W·(1 − lr·wd)``.
10. Update the selected rows only: ``W[I, :] ← W[I, :] − η·D``.

At ``f = 1`` every row is selected every step, so this is Muon / NorMuon with momentum
``U_t = mu·U_{t−1} + G_t`` (no Nesterov).
"""

from __future__ import annotations

import math

import numpy as np

POLAR_EXPRESS = [(a / 1.05, b / 1.05**3, c / 1.05**5) for a, b, c in [
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
]]


def ns_polar(x: np.ndarray, coeffs=POLAR_EXPRESS, eps: float = 1e-7) -> np.ndarray:
    """Standard Newton-Schulz in float64 (the package's Gram NS equals it in exact arithmetic)."""
    x = np.asarray(x, np.float64)
    t = x.shape[0] > x.shape[1]
    if t:
        x = x.T
    x = x / (np.linalg.norm(x) + eps)
    for a, b, c in coeffs:
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if t else x


def k_rule(f: float, n: int) -> int:
    return max(1, math.ceil(f * n))


def lr_factor(adjust, fan_out, fan_in):
    if adjust == "spectral_norm":
        return math.sqrt(fan_out / fan_in)
    if adjust == "rms_norm":
        return 0.2 * math.sqrt(max(fan_out, fan_in))
    return 1.0


def dion3_matrix_step(W, G, M, v, *, lr, f, mu, beta2, wd, flavor, adjust, polar=ns_polar):
    """One step on one (n × C) matrix. Returns new (W, M, v). v has shape (n,)."""
    W, G, M, v = (np.array(a, np.float64) for a in (W, G, M, v))
    n, C = M.shape
    M = M + G                                         # 1
    s = np.abs(M).sum(axis=1)                         # 2
    k = k_rule(f, n)                                  # 3
    I = np.argsort(-s, kind="stable")[:k]
    S = M[I, :].copy()                                # 4
    M[I, :] = mu * S                                  # 5
    O = polar(S)                                      # 6
    if flavor == "normuon":                          # 7
        nO = np.linalg.norm(O)
        nu = (O**2).mean(axis=1)
        v[I] = beta2 * v[I] + (1 - beta2) * nu
        D = O / (np.sqrt(v[I])[:, None] + 1e-8)
        D = D * nO / max(np.linalg.norm(D), 1e-8)
    else:
        D = O
    eta = lr * lr_factor(adjust, n, C)                # 8
    W = W * (1 - lr * wd)                             # 9
    W[I, :] = W[I, :] - eta * D                       # 10
    return W, M, v
