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
"""Restart Gram Newton-Schulz from its first Gram matrix instead of from ``X``?

The default restart (step 2) forms ``X ← Q₁ X`` in float16 and a fresh Gram matrix ``R ← X Xᵀ``:
about ``1.5·r`` products of ``n³`` multiply-adds for a wide ``n × m`` matrix of aspect
``r = m / n``. The same matrix is ``Q₁ R₀ Q₁`` (``Q₁`` symmetric, ``R₀`` the first Gram matrix),
which costs no pass over ``X``; the result is then ``(Q₂ Q₁) X``. The restart exists to reset the
spurious negative eigenvalues that float16 rounding leaves in ``R`` (``dion3_jax/_restarts.py``),
so the new form only helps if its ``R`` is as accurate as a fresh Gram matrix. The forms:

* ``iterate``: the default, ``X ← Q₁ X`` then ``X Xᵀ``;
* ``gram16``: ``R₀`` kept in float16, ``R ← Q₁ (R₀ Q₁)``: 1.5 products, plus 1 for ``Q₂ Q₁``;
* ``gram32``: ``R₀`` kept in float32 and multiplied as two float16 halves
  (``hi = fl16(R₀·s)``, ``lo = fl16((R₀·s − hi)·2¹²)``, ``s`` a power of two that lifts the
  entries out of float16's subnormals), ``T = R₀ Q₁`` rounded to float16: 2.5 products, plus 1;
* ``gram32x2``: as ``gram32`` with ``T`` kept in float32 and split too: 3 products, plus 1.

Per shape and spectrum, in one process on the same inputs: the spectral-norm distance of each
form's ``R`` from ``Q₁ R₀ Q₁`` in float64 (``Q₁`` the same float16 iterate, ``R₀`` exact), its
most negative eigenvalue, and the relative Frobenius error of the whole 5-step polar against
float64's ``U Vᵀ`` with that restart, with the largest singular value of the result (above
about 1.13, the spurious eigenvalues were amplified; "non-finite" where a form overflowed). A
tall input is iterated as its wide
transpose (``polar(Xᵀ) = polar(X)ᵀ``).

Usage::

    python benchmarks/restart_form.py                     # the table (CPU, about a minute)
    python benchmarks/restart_form.py --small             # a smoke run
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dion3_jax import _polar  # noqa: E402
from dion3_jax._coefficients import get_coefficients  # noqa: E402

FORMS = ("iterate", "gram16", "gram32", "gram32x2")
#: Products of ``n³`` multiply-adds per restart, and once at the end (``Q₂ Q₁``).
COST = {"gram16": (1.5, 1.0), "gram32": (2.5, 1.0), "gram32x2": (3.0, 1.0)}
SPECTRA = ("gauss", "decay", "steep")
FULL = [(256, 1024), (128, 1376), (1024, 256), (256, 2048)]
SMALL = [(32, 128)]


def make_input(n: int, m: int, spectrum: str, rng: np.random.Generator) -> np.ndarray:
    """A ``(1, n, m)`` float64 matrix of Frobenius norm 1/1.01: Gaussian, or with singular
    values log-spaced from 1 down to 1e-4 (``decay``) or 1e-7 (``steep``)."""
    if spectrum == "gauss":
        x = rng.standard_normal((n, m))
    else:
        k = min(n, m)
        u = np.linalg.qr(rng.standard_normal((n, k)))[0]
        v = np.linalg.qr(rng.standard_normal((m, k)))[0]
        x = (u * np.logspace(0, -4 if spectrum == "decay" else -7, k)) @ v.T
    return (x / np.linalg.norm(x) / 1.01)[None]


def _mm(a, b, out_dtype):
    """``a @ b`` with float32 accumulation, rounded once to ``out_dtype``."""
    return jnp.einsum("bij,bjk->bik", a, b, preferred_element_type=jnp.float32).astype(out_dtype)


def _halves(a: jax.Array, scale: float) -> tuple[jax.Array, jax.Array]:
    """``a·scale ≈ hi + lo·2⁻¹²`` with both halves in float16."""
    a = a * scale
    hi = a.astype(jnp.float16)
    return hi, ((a - hi.astype(a.dtype)) * 2.0**12).astype(jnp.float16)


def _split_product(a32: jax.Array, b16: jax.Array, scale: float, left: bool) -> jax.Array:
    """``a32 @ b16`` (or ``b16 @ a32`` with ``left``) times ``scale``, in float32, from the
    float16 halves of ``a32``."""
    hi, lo = _halves(a32, scale)
    if left:
        return _mm(b16, hi, jnp.float32) + _mm(b16, lo, jnp.float32) * 2.0**-12
    return _mm(hi, b16, jnp.float32) + _mm(lo, b16, jnp.float32) * 2.0**-12


def restarted_gram(form: str, q: jax.Array, r0: jax.Array) -> jax.Array:
    """``Q R₀ Qᵀ`` by ``form`` (not "iterate"), for the accumulated float16 ``q`` of a wide
    ``X`` and its first Gram matrix ``r0`` in float32 (``Q`` is symmetric only up to
    rounding, so the transpose is kept)."""
    qt = jnp.swapaxes(q, -1, -2)
    if form == "gram16":
        return _mm(q, _mm(r0.astype(jnp.float16), qt, jnp.float16), jnp.float16)
    s = float(2.0 ** np.ceil(np.log2(r0.shape[-1])))   # entries of R₀ are about 1/n
    t = _split_product(r0, qt, s, left=False)          # s · R₀ Qᵀ
    if form == "gram32":
        return (_mm(q, t.astype(jnp.float16), jnp.float32) / s).astype(jnp.float16)
    return (_split_product(t, q, 1.0, left=True) / s).astype(jnp.float16)


def gram_newton_schulz(x: jax.Array, form: str, probe: list | None = None) -> jax.Array:
    """The default 5-step polar (restart at step 2) of a wide ``x`` with the restart ``form``;
    ``probe`` receives ``(Q₁, R)`` at the restart."""
    coeffs = get_coefficients("polar_express")
    r0 = jnp.einsum("bik,bjk->bij", x, x, preferred_element_type=jnp.float32)
    r, q, acc = r0.astype(x.dtype), None, None
    for i, k in enumerate(_polar._operands(coeffs, x.dtype)):
        if i == 2:  # the restart
            if form == "iterate":
                x, r = _polar._restart(q, x, "xla")
            else:
                r, acc = restarted_gram(form, q, r0), q
            if probe is not None:
                probe.append((q, r))
            q = None
        update = i != len(coeffs) - 1 and i + 1 != 2
        if q is None:
            r, q = _polar._gram_first(r, k, "xla", update)
        else:
            r, q = _polar._gram_next(r, q, k, "xla", update)
    if acc is not None:
        q = _mm(q, acc, jnp.float16)
    return _polar._apply(q, x)


def _exact_polar(x: np.ndarray) -> np.ndarray:
    u, _, vt = np.linalg.svd(x[0], full_matrices=False)
    return (u @ vt)[None]


def row(shape, spectrum: str, form: str, x64: np.ndarray) -> list:
    """One table row: the restarted ``R``'s error and smallest eigenvalue, the polar's error
    and largest singular value."""
    tall = shape[0] > shape[1]
    x64 = np.swapaxes(x64, 1, 2) if tall else x64   # polar(Xᵀ) = polar(X)ᵀ: iterate wide
    x = jnp.asarray(x64, jnp.float16)
    probe: list = []
    out = np.asarray(gram_newton_schulz(x, form, probe), np.float64)[0]
    q, r = (np.asarray(a, np.float64)[0] for a in probe[0])
    xs = np.asarray(x, np.float64)[0]
    exact = q @ (xs @ xs.T) @ q.T
    err = np.linalg.norm(out - _exact_polar(x64)[0]) / np.linalg.norm(_exact_polar(x64)[0])
    aspect = max(shape) / min(shape)
    cost = 1.5 * aspect if form == "iterate" else sum(COST[form])
    if not (np.isfinite(r).all() and np.isfinite(out).all()):
        return ["x".join(map(str, shape)), spectrum, form, f"{cost:.2f}",
                *(["non-finite"] * 2), f"{np.linalg.eigvalsh(exact).min():+.2e}",
                *(["non-finite"] * 2)]
    return ["x".join(map(str, shape)), spectrum, form, f"{cost:.2f}",
            f"{np.linalg.norm(r - exact, 2):.2e}", f"{np.linalg.eigvalsh(r).min():+.2e}",
            f"{np.linalg.eigvalsh(exact).min():+.2e}", f"{err:.4e}",
            f"{np.linalg.svd(out, compute_uv=False).max():.3f}"]


def main(argv=None) -> list[list]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="one tiny shape (a smoke run)")
    p.add_argument("--seed", type=int, default=0, help="the inputs' seed")
    args = p.parse_args(argv)
    with jax.enable_x64(True):
        return _table(args)


def _table(args: argparse.Namespace) -> list[list]:
    """Prints the table and returns its rows."""
    rng = np.random.default_rng(args.seed)
    print(f"seed {args.seed}; jax {jax.__version__} on {jax.devices()[0].platform}")
    header = ["shape", "spectrum", "form", "products", "‖R − exact‖₂", "λmin(R)",
              "λmin(exact)", "polar error", "σmax"]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    rows = []
    for shape in (SMALL if args.small else FULL):
        for spectrum in SPECTRA:
            x64 = make_input(*shape, spectrum, rng)
            for form in FORMS:
                rows.append(row(shape, spectrum, form, x64))
                print("| " + " | ".join(rows[-1]) + " |", flush=True)
    return rows


if __name__ == "__main__":
    main()
