"""The step reproduces, bitwise on the CPU, outputs recorded before the plan-and-phases redesign.

``tests/data/golden_step.npz`` holds, for fixed inputs, the updates of three consecutive steps and
the final state of ``scale_by_dion3`` with its default configuration (NorMuon, Gram Newton-Schulz,
float16) at ``f = 1`` and ``f = 1/4``, on one device and on an 8-device FSDP mesh (row-, column-
and batch-sharded leaves, replicated leaves). The data was written by the pre-redesign step
(commit b467ab5) with ``python tests/test_golden_step.py --write`` and the redesigned step
reproduced all of it bitwise. Rewriting it is a deliberate change of the update's bits and must
say so in its commit. It was rewritten once since: when the all-to-all payload started to travel
normalised in float16, the mesh f = 1 case changed by float16 rounding (~1e-3; its norms are
summed in another order). It was rewritten a second time when the polar stopped transposing
tall payloads (Gram Newton-Schulz on ``Xᵀ X``) and square ones took ``X ← (a·I + b·A + c·A²) X``
as one float16 product: every case whose payloads are tall or square changed by float16
rounding (relative 1e-3 to 8e-3; the wide ``mlp_up``/``mlp_gate`` at f = 1 kept their bits),
and ``tests/test_transform.py``'s float64 references still hold. It was rewritten a third time
when NorMuon's per-matrix sums (the factors' row norms, ``‖O‖_F²`` and ``‖O/a‖_F²``, the selected
rows' sums of squares) started to run once per batch on stacked arrays instead of per matrix:
float32 rounding of those sums, at most 9e-7 relative in any output. It was rewritten a fourth
time when the momentum started to travel as ``(M, d)`` with the selected rows' decay deferred to
the next step's ``S = d ⊙ M + G`` (``m/`` now records ``state.full_momentum()``): the updates at
f = 1/4 and on one device at f = 1 kept their bits, the momenta moved by one float32 rounding
(``d·M + G`` may be a fused multiply-add), and the mesh f = 1 case changed by float16 rounding
(at most 3e-3 relative: its payload norms now sum the statistics pass's row sums).
"""

from __future__ import annotations

import pathlib
import sys

import jax

if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)

from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
import pytest

import dion3_jax

DATA = pathlib.Path(__file__).parent / "data" / "golden_step.npz"
STEPS = 3
FRACTIONS = {"f1": 1.0, "f025": 0.25}

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


def _tree(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(shape).astype(np.float32)
            for k, (shape, _) in LEAVES.items()}


def _run(fraction: float, mesh) -> dict[str, np.ndarray]:
    """Three steps of the default ``scale_by_dion3``; flat dict of the outputs."""
    params = _tree(0)
    grads = [_tree(s + 1) for s in range(STEPS)]
    if mesh is not None:
        put = lambda t: {k: jax.device_put(v, NamedSharding(mesh, LEAVES[k][1]))  # noqa: E731
                         for k, v in t.items()}
        params, grads = put(params), [put(g) for g in grads]
    tx = dion3_jax.scale_by_dion3(fraction, mu=0.95)   # the recorded (reference) default
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
    for name, f in FRACTIONS.items():
        yield f"single_{name}", f, False
        yield f"mesh8_{name}", f, True


def _mesh():
    return jax.make_mesh((8,), ("fsdp",), devices=jax.devices("cpu")[:8])


def _compute(f: float, sharded: bool) -> dict[str, np.ndarray]:
    if not sharded:
        return _run(f, None)
    mesh = _mesh()
    with jax.set_mesh(mesh):
        return _run(f, mesh)


@pytest.mark.skipif(jax.default_backend() != "cpu" or len(jax.devices("cpu")) < 8,
                    reason="bitwise reference recorded on 8 CPU devices")
# The fast loop runs the single-device f = 1/4 case (selection, error feedback, the polar); f = 1
# and the mesh cases run with the slow tests.
@pytest.mark.parametrize("case,f,sharded", [
    pytest.param(*c, id=c[0], marks=[pytest.mark.slow] if c[2] or c[1] == 1.0 else [])
    for c in _cases()])
def test_step_reproduces_recorded_outputs_bitwise(case, f, sharded):
    want = np.load(DATA)
    got = _compute(f, sharded)
    keys = sorted(k.split("/", 1)[1] for k in want.files if k.startswith(case + "/"))
    assert keys == sorted(got), (keys, sorted(got))
    for k in keys:
        w, g = want[f"{case}/{k}"], got[k]
        assert g.dtype == w.dtype and g.shape == w.shape, k
        diff = np.flatnonzero(g.view(np.uint32) != w.view(np.uint32))
        assert diff.size == 0, f"{case}/{k}: {diff.size} of {g.size} elements differ"


def _write() -> None:
    out = {}
    for case, f, sharded in _cases():
        out.update({f"{case}/{k}": v for k, v in _compute(f, sharded).items()})
    DATA.parent.mkdir(exist_ok=True)
    np.savez_compressed(DATA, **out)
    print(f"wrote {DATA} ({len(out)} arrays)")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_golden_step.py --write")
    _write()
