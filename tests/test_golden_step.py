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
"""The step reproduces recorded outputs: bitwise on a machine that rounds like the recording one,
to a stated tolerance on any other.

``tests/data/golden_step.npz`` holds, for fixed inputs, the updates of three consecutive steps and
the final state (momentum ``state.full_momentum()``, NorMuon variance) of ``scale_by_dion3`` at
``f = 1`` and ``f = 1/4``, on one device and on an 8-device FSDP mesh (row-, column- and
batch-sharded leaves, replicated leaves), in two configurations:

- ``default``: the default polar (Gram Newton-Schulz in float16). Its outputs carry float16
  rounding, and XLA:CPU's float32 products block their sums by the CPU's caches and instruction
  set, so another CPU model moves them by up to about 1e-2 relative.
- ``float32``: standard Newton-Schulz in float32. Across the CPUs and instruction sets tried its
  outputs move by at most 3e-6 relative, so it holds a tight tolerance (``TOLERANCE``) on every
  machine: one row's error-feedback decay dropped, or NorMuon's rescale off by 1%, fails it
  (``test_a_real_change_fails_the_float32_guard``).

The data also holds a fingerprint of the recording machine's rounding: the bits of a few XLA:CPU
products and elementwise functions of fixed inputs (:func:`fingerprint`). Where this machine's
fingerprint matches, every output must match bitwise; elsewhere each output must lie within
``TOLERANCE[config]`` of the recorded one, relative to the largest recorded magnitude of its
array. ``XLA_FLAGS=--xla_cpu_max_isa=AVX`` (no FMA) changes the fingerprint on any x86 machine,
so CI also runs this file under it (``scripts/test.sh``).

Rewriting the data (``python tests/test_golden_step.py --write``) is a deliberate change of the
update's bits and must say so in its commit.
"""

from __future__ import annotations

import functools
import hashlib
import pathlib
import sys

import jax

if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import dion3_jax  # noqa: E402
from dion3_jax import _rules  # noqa: E402

DATA = pathlib.Path(__file__).parent / "data" / "golden_step.npz"
# The data holds the bits of XLA's default compiles (conftest turns most optimizations off).
pytestmark = pytest.mark.usefixtures("default_xla_optimizations")
STEPS = 3
FRACTIONS = {"f1": 1.0, "f025": 0.25}
#: Off the recording machine: the largest allowed ``|got − recorded| / max |recorded|`` per array.
TOLERANCE = {"default": 3e-2, "float32": 5e-5}

# name: (shape, spec on the 8-device mesh). Two leaves share each of two shapes (megabatching).
LEAVES = {
    "attn_q": ((32, 32), P(None, "fsdp")),          # square, rows sharded
    "attn_o": ((32, 32), P("fsdp", None)),          # square, columns sharded
    "mlp_up": ((32, 88), P(None, "fsdp")),         # wide: rows sharded
    "mlp_gate": ((32, 88), P(None, "fsdp")),
    "mlp_down": ((88, 32), P("fsdp", None)),       # tall: columns sharded
    "stacked": ((8, 16, 24), P("fsdp", None, None)),  # stacked layers, batch axis sharded
    "small_a": ((12, 20), P()),                     # replicated: the group's batch is split
    "small_b": ((12, 20), P()),
}


def _orthogonalizer(config: str):
    if config == "default":
        return None
    return dion3_jax.make_orthogonalizer(method="standard", compute_dtype=jnp.float32)


@functools.cache
def fingerprint() -> str:
    """A hash of this machine's XLA:CPU rounding: float32 and float16-input products of the
    shapes the step multiplies, and the elementwise functions it uses, on fixed inputs (computed
    once per process: each case of the test compares against it)."""
    rng = np.random.default_rng(7)
    shapes = [(32, 88), (88, 32), (32, 32), (16, 24), (12, 20), (128, 512)]
    xs = [rng.standard_normal(s).astype(np.float32) for s in shapes]

    @jax.jit
    def probe(xs):
        out = []
        for x in xs:
            g = x @ x.T
            h = jnp.dot(x.astype(jnp.float16), x.T.astype(jnp.float16),
                        preferred_element_type=jnp.float32)
            out += [g, h, g @ g @ x, jnp.sqrt(jnp.abs(x)) / (jnp.sum(x * x) + 1e-7),
                    jax.lax.rsqrt(jnp.abs(x) + 1.0)]
        return out

    bits = b"".join(np.asarray(y).tobytes() for y in probe(xs))
    return hashlib.sha256(bits).hexdigest()[:16]


def _tree(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(shape).astype(np.float32)
            for k, (shape, _) in LEAVES.items()}


def _run(config: str, fraction: float, mesh) -> dict[str, np.ndarray]:
    """Three steps of ``scale_by_dion3`` in ``config``; flat dict of the outputs."""
    params = _tree(0)
    grads = [_tree(s + 1) for s in range(STEPS)]
    if mesh is not None:
        put = lambda t: {k: jax.device_put(v, NamedSharding(mesh, LEAVES[k][1]))  # noqa: E731
                         for k, v in t.items()}
        params, grads = put(params), [put(g) for g in grads]
    tx = dion3_jax.scale_by_dion3(fraction, mu=0.95, orthogonalizer=_orthogonalizer(config))
    state = tx.init(params)
    update = jax.jit(tx.update)
    out = {}
    for s, g in enumerate(grads):
        u, state = update(g, state)
        out.update({f"u{s}/{k}": np.asarray(v) for k, v in u.items()})
    out.update({f"m/{k}": np.asarray(v) for k, v in state.full_momentum().items()})
    out.update({f"v/{k}": np.asarray(v) for k, v in state.variance.items()})
    return out


def _cases():
    for config in TOLERANCE:
        for name, f in FRACTIONS.items():
            yield f"{config}/single_{name}", config, f, False
            yield f"{config}/mesh8_{name}", config, f, True


def _compute(config: str, f: float, sharded: bool) -> dict[str, np.ndarray]:
    if not sharded:
        return _run(config, f, None)
    mesh = jax.make_mesh((8,), ("fsdp",), devices=jax.devices("cpu")[:8])
    with jax.set_mesh(mesh):
        return _run(config, f, mesh)


def _mismatches(case: str, config: str, got: dict, bitwise: bool) -> list[str]:
    """The outputs of ``case`` that differ from the recorded ones (bitwise, or beyond
    ``TOLERANCE[config]``)."""
    want = np.load(DATA)
    keys = sorted(k[len(case) + 1:] for k in want.files if k.startswith(case + "/"))
    assert keys and keys == sorted(got), (keys, sorted(got))
    bad = []
    for k in keys:
        w, g = want[f"{case}/{k}"], got[k]
        assert g.dtype == w.dtype and g.shape == w.shape, k
        if bitwise:
            n = np.count_nonzero(g.view(np.uint32) != w.view(np.uint32))
            if n:
                bad.append(f"{k}: {n} of {g.size} elements differ")
            continue
        err = np.max(np.abs(g.astype(np.float64) - w)) / max(np.max(np.abs(w)), 1e-30)
        if not err <= TOLERANCE[config]:
            bad.append(f"{k}: relative error {err:.2e} > {TOLERANCE[config]:.0e}")
    return bad


_EIGHT_CPUS = pytest.mark.skipif(jax.default_backend() != "cpu" or len(jax.devices("cpu")) < 8,
                                 reason="recorded on 8 CPU devices")


@_EIGHT_CPUS
# The fast loop runs the single-device f = 1/4 case of the float32 configuration (selection,
# error feedback, the polar: the guard that holds tightly on every machine); the default
# configuration, f = 1 and the mesh cases run with the slow tests.
@pytest.mark.parametrize("case,config,f,sharded", [
    pytest.param(*c, id=c[0], marks=[pytest.mark.slow] if c[3] or c[2] == 1.0
                 or c[1] == "default" else [])
    for c in _cases()])
def test_step_reproduces_recorded_outputs(case, config, f, sharded):
    bitwise = str(np.load(DATA)["fingerprint"]) == fingerprint()
    bad = _mismatches(case, config, _compute(config, f, sharded), bitwise)
    assert not bad, f"{case} ({'bitwise' if bitwise else 'tolerance'}): {bad}"


def _drop_one_rows_decay(orig):
    def patched(mu, keep, shape):
        return orig(mu, keep, shape).at[0, 0].set(1.0)
    return patched


def _off_by_one_percent(orig):
    return lambda a, fro: 1.01 * orig(a, fro)


@_EIGHT_CPUS
@pytest.mark.slow  # ~5 s: a check of the guard itself, not of the step
@pytest.mark.parametrize("target,mutate", [
    ("deferred_decay", _drop_one_rows_decay),
    pytest.param("normuon_row_scales", _off_by_one_percent, marks=pytest.mark.slow)])
def test_a_real_change_fails_the_float32_guard(monkeypatch, target, mutate):
    """The float32 guard's tolerance is tight enough to catch a real change on any machine."""
    monkeypatch.setattr(_rules, target, mutate(getattr(_rules, target)))
    got = _compute("float32", 0.25, False)
    assert _mismatches("float32/single_f025", "float32", got, bitwise=False)


def _write() -> None:
    out = {"fingerprint": np.array(fingerprint())}
    for case, config, f, sharded in _cases():
        out.update({f"{case}/{k}": v for k, v in _compute(config, f, sharded).items()})
    DATA.parent.mkdir(exist_ok=True)
    np.savez_compressed(DATA, **out)
    print(f"wrote {DATA} ({len(out)} arrays, fingerprint {out['fingerprint']})")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_golden_step.py --write")
    _write()
