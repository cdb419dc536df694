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
"""Tests for the Gram Newton-Schulz restart autotune (``dion3_jax._restarts``)."""

import itertools
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from dion3_jax._coefficients import PRESETS, get_coefficients
from dion3_jax._restarts import (
    DEFAULT_MAX_GROWTH,
    autotune_restarts,
    main,
    restart_candidates,
    restart_growth,
    simulate_gram_eigenvalues,
)

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _all_sets(steps, k):
    return itertools.combinations(range(1, steps), k)


def test_polar_express_default_is_reference_default():
    # The reference (Dao-AILab/gram-newton-schulz) uses restarts=(2,) and reports growth 84.6.
    assert autotune_restarts() == (2,)
    assert autotune_restarts("polar_express") == (2,)
    assert restart_growth("polar_express", (2,)) == pytest.approx(84.57, abs=0.01)


@pytest.mark.parametrize("name,expected", [("you", (2,)), ("jordan", (3,))])
def test_other_presets(name, expected):
    assert autotune_restarts(name) == expected


@pytest.mark.parametrize("name,steps,max_growth", [
    ("polar_express", None, DEFAULT_MAX_GROWTH),
    ("polar_express", None, 50.0),
    ("polar_express", 8, DEFAULT_MAX_GROWTH),
    ("polar_express", 10, DEFAULT_MAX_GROWTH),
    ("you", None, DEFAULT_MAX_GROWTH),
    ("you", 8, 100.0),
    ("jordan", None, DEFAULT_MAX_GROWTH),
    ("jordan", 6, 30.0),
])
def test_chosen_set_is_minimal_and_within_bound(name, steps, max_growth):
    n = len(get_coefficients(name, steps))
    chosen = autotune_restarts(name, steps=steps, max_growth=max_growth)
    growth = restart_growth(name, chosen, steps=steps)
    assert growth <= max_growth
    for k in range(len(chosen)):
        for combo in _all_sets(n, k):
            assert restart_growth(name, combo, steps=steps) > max_growth, combo
    # Among sets of the same size, nothing grows less.
    for combo in _all_sets(n, len(chosen)):
        assert restart_growth(name, combo, steps=steps) >= growth


def test_restarts_matter_for_polar_express():
    no_restart = restart_growth("polar_express")
    assert no_restart > DEFAULT_MAX_GROWTH
    assert no_restart > 1e12
    assert restart_growth("polar_express", (2,)) < 100
    # The blow-up comes from the spurious eigenvalue: exact arithmetic needs no restart.
    assert restart_growth("polar_express", spurious_eigenvalue=0.0) <= DEFAULT_MAX_GROWTH
    assert autotune_restarts("polar_express", spurious_eigenvalue=0.0) == ()


def test_more_negative_spurious_eigenvalue_grows_more():
    growths = [restart_growth("polar_express", (2,), spurious_eigenvalue=p)
               for p in (0.0, -1e-4, -4e-4, -1e-3)]
    assert growths == sorted(growths)


def test_num_restarts_mode_matches_exhaustive_minimum():
    for name in PRESETS:
        for k in (1, 2):
            best = min(_all_sets(len(PRESETS[name]), k), key=lambda s: restart_growth(name, s))
            assert autotune_restarts(name, num_restarts=k) == best
    assert autotune_restarts("polar_express", num_restarts=2) == (1, 2)


def test_candidates_are_complete_and_sorted():
    rows = restart_candidates("polar_express", 2)
    assert len(rows) == math.comb(4, 2)
    assert sorted(r[0] for r in rows) == list(_all_sets(5, 2))
    growths = [r[1] for r in rows]
    assert growths == sorted(growths)
    for combo, growth in rows:
        assert growth == restart_growth("polar_express", combo)


def _matrix_gram_newton_schulz(U, V, sigma, coeffs, restarts, spurious):
    """Float64 Gram NS on X = U diag(σ) Vᵀ, injecting ``spurious·I`` into every Gram matrix."""
    n = U.shape[0]
    eye = np.eye(n)
    X = U @ np.diag(sigma) @ V.T
    R = X @ X.T + spurious * eye
    Q = None
    qs = []
    for i, (a, b, c) in enumerate(coeffs):
        if i in restarts:
            X = Q @ X
            R = X @ X.T + spurious * eye
            Q = None
        Z = b * R + c * (R @ R)
        Q = Z + a * eye if Q is None else Q @ Z + a * Q
        qs.append(Q)
        if i < len(coeffs) - 1 and i + 1 not in restarts:
            RZ = R @ Z + a * R
            R = Z @ RZ + a * RZ
    return qs, Q @ X


@pytest.mark.parametrize("name", ["polar_express", "you", "jordan"])
@pytest.mark.parametrize("restarts", [(), (2,), (3,), (1, 3), (1, 2, 3, 4)])
def test_scalar_recursion_matches_matrix_iteration(name, restarts):
    rng = np.random.default_rng(0)
    n, m = 6, 9
    U, _ = np.linalg.qr(rng.standard_normal((n, n)))
    V, _ = np.linalg.qr(rng.standard_normal((m, n)))
    # σ = 0 gives the Gram eigenvalue exactly -4e-4; σ = 1e-3 gives 1e-6 - 4e-4 < 0 too.
    sigma = np.array([1.0, 0.7, 0.2, 3e-2, 1e-3, 0.0])
    spurious = -4e-4
    coeffs = get_coefficients(name)
    qs, out = _matrix_gram_newton_schulz(U, V, sigma, coeffs, set(restarts), spurious)
    trace = simulate_gram_eigenvalues(name, restarts, spurious_eigenvalue=spurious,
                                      singular_values=sigma)
    assert np.linalg.eigvalsh(U @ np.diag(sigma**2 + spurious) @ U.T).min() < 0
    well_conditioned = restart_growth(name, restarts, singular_values=sigma) < 1e3
    for i, Q in enumerate(qs):
        D = U.T @ Q @ U
        q_matrix = np.diag(D)
        scale = np.abs(trace.q[i]).max()
        np.testing.assert_allclose(q_matrix, trace.q[i], rtol=0, atol=1e-10 * scale)
        assert np.abs(D - np.diag(q_matrix)).max() <= 1e-10 * scale
        if well_conditioned:
            np.testing.assert_allclose(q_matrix, trace.q[i], rtol=1e-10)
    out_sv = np.diag(U.T @ out @ V)
    expected = trace.q[-1] * trace.x[-1]
    np.testing.assert_allclose(out_sv, expected, rtol=0, atol=1e-10 * np.abs(expected).max())


@pytest.mark.parametrize("name", ["polar_express", "you", "jordan"])
def test_restarts_do_not_change_exact_arithmetic(name):
    sigma = np.logspace(0, -6, 200)
    reference = sigma.copy()
    for a, b, c in get_coefficients(name):  # Standard Newton-Schulz on the singular values.
        reference = reference * (a + b * reference**2 + c * reference**4)
    for k in range(5):
        for combo in _all_sets(5, k):
            trace = simulate_gram_eigenvalues(name, combo, spurious_eigenvalue=0.0,
                                              singular_values=sigma)
            np.testing.assert_allclose(trace.q[-1] * trace.x[-1], reference, rtol=1e-11)


def test_steps_pads_presets():
    assert restart_growth("polar_express", steps=8) == math.inf
    assert autotune_restarts("polar_express", steps=8) == (2, 4)
    assert autotune_restarts("polar_express", steps=1) == ()


def test_user_coefficients():
    coeffs = [list(t) for t in PRESETS["you"]]
    assert autotune_restarts(coeffs) == autotune_restarts("you")
    assert restart_growth(coeffs, [2]) == restart_growth("you", (2,))


@pytest.mark.parametrize("kwargs,match", [
    (dict(restarts=(0,)), "restart"),
    (dict(restarts=(5,)), "restart"),
    (dict(restarts=(-1,)), "restart"),
    (dict(restarts=(2, 2)), "restarts"),
    (dict(restarts=(True,)), "restarts"),
    (dict(restarts=(1.5,)), "restarts"),
    (dict(restarts=3), "restarts"),
    (dict(spurious_eigenvalue=1e-4), "spurious_eigenvalue"),
    (dict(spurious_eigenvalue=float("nan")), "spurious_eigenvalue"),
    (dict(singular_values=np.ones((2, 2))), "singular_values"),
    (dict(singular_values=[-1.0]), "singular_values"),
    (dict(singular_values=[]), "singular_values"),
    (dict(coefficients="nope"), "preset"),
    (dict(coefficients=[(1.0, 2.0)]), "coefficients"),
    (dict(steps=0), "steps"),
])
def test_restart_growth_rejects_bad_arguments(kwargs, match):
    kwargs = {"coefficients": "polar_express", **kwargs}
    with pytest.raises(ValueError, match=match):
        restart_growth(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_growth=0.5), "max_growth"),
    (dict(max_growth=float("inf")), "max_growth"),
    (dict(max_growth="big"), "max_growth"),
    (dict(max_restarts=-1), "max_restarts"),
    (dict(max_restarts=1.0), "max_restarts"),
    (dict(num_restarts=5), "num_restarts"),
    (dict(num_restarts=-1), "num_restarts"),
    (dict(spurious_eigenvalue=4e-4), "spurious_eigenvalue"),
    (dict(max_restarts=0), "max_growth"),  # no restart: growth 2.7e12 > 2048.
    (dict(max_growth=1.0), "max_growth"),  # unreachable.
])
def test_autotune_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        autotune_restarts("polar_express", **kwargs)


def _run_cli(*args):
    return subprocess.run([sys.executable, "-m", "dion3_jax.newton_schulz", *args], cwd=_REPO_ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # a process; test_readme.py runs the same entry point in the fast loop
def test_cli_prints_table_and_choice():
    result = _run_cli("--coefficients", "polar_express")
    assert result.returncode == 0, result.stderr
    assert "chosen restarts: (2,)" in result.stdout
    assert "2.694e+12" in result.stdout  # the no-restart row
    assert "84.57" in result.stdout


def test_cli_user_coefficients(tmp_path, capsys):
    """The three ways to give coefficients, through ``main`` in-process (the command's
    ``python -m`` entry point runs in test_cli_prints_table_and_choice)."""
    coeffs = [list(t) for t in PRESETS["jordan"]]
    assert main(["--coefficients", json.dumps(coeffs), "--steps", "6"]) == 0
    assert "chosen restarts: (2,)" in capsys.readouterr().out  # growth 667.7
    path = tmp_path / "coeffs.json"
    path.write_text(json.dumps(coeffs))
    assert main(["--coefficients", str(path), "--max-growth", "100"]) == 0
    assert "chosen restarts: (3,)" in capsys.readouterr().out
    semicolons = ";".join(",".join(map(str, t)) for t in PRESETS["you"])
    main(["--coefficients", semicolons])
    assert "chosen restarts: (2,)" in capsys.readouterr().out


def test_cli_errors(capsys):
    assert main(["--max-restarts", "0"]) == 1
    assert "no restart set" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--spurious", "1e-3"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["--coefficients", "not-a-preset"])
    assert e.value.code == 2
