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
"""The quality study's parameter-storage variants (``examples/param_rounding.py``, ``--plan
rounding``): ``once`` adds the float32 update and rounds once, ``twice`` rounds the update to the
parameter's dtype first; the float32 view leaves Dion3's matrix updates as the library makes them.

References are numpy (``ml_dtypes`` bfloat16, round to nearest even): ``once`` is
``bf16(f32(W) + u)``, ``twice`` is ``bf16(f32(W) + f32(bf16(u)))``, bitwise.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import dion3_jax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

import param_rounding  # noqa: E402
from seeds import module_seed  # noqa: E402

pytestmark = pytest.mark.tooling

#: Every run draws fresh inputs (printed with each test by ``conftest.print_module_seed``).
SEED = module_seed()
BF16 = ml_dtypes.bfloat16


def _once(w, u):
    return (np.asarray(w, np.float32) + np.asarray(u, np.float32)).astype(BF16)


def _twice(w, u):
    rounded = np.asarray(u, np.float32).astype(BF16).astype(np.float32)
    return (np.asarray(w, np.float32) + rounded).astype(BF16)


def _same_bits(a, b) -> bool:
    return np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))


def test_once_and_twice_match_their_references_and_differ():
    """Updates from 1e-4 to 10 times the weight: both variants match their numpy references
    bitwise, and they disagree on a share of the elements (the rounding of the update)."""
    rng = np.random.default_rng(SEED)
    w = rng.standard_normal((256, 256)).astype(BF16)
    scale = 10.0 ** rng.uniform(-4, 1, w.shape)
    u = (rng.choice([-1, 1], w.shape) * scale * np.abs(w.astype(np.float32))).astype(np.float32)
    params, updates = {"w": jnp.asarray(w)}, {"w": jnp.asarray(u)}
    once = param_rounding.apply_updates(params, updates, "once")["w"]
    twice = param_rounding.apply_updates(params, updates, "twice")["w"]
    assert once.dtype == twice.dtype == jnp.bfloat16
    assert _same_bits(once, _once(w, u)) and _same_bits(twice, _twice(w, u))
    differ = float(np.mean(np.asarray(once) != np.asarray(twice)))
    print("share rounded differently", differ)
    assert differ > 0.01, differ
    # float32 parameters: the update's "rounding" to float32 changes nothing.
    w32 = {"w": jnp.asarray(w, jnp.float32)}
    a, b = (param_rounding.apply_updates(w32, updates, r)["w"] for r in ("once", "twice"))
    assert np.array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="'thrice'"):
        param_rounding.apply_updates(params, updates, "thrice")


def test_float32_view_keeps_the_librarys_matrix_updates():
    """Dion3 (f = 1/4, weight decay) on bfloat16 params for three steps: through the float32
    view the matrix's updates are the library's own float32 updates, bitwise; the AdamW
    branch's bias gets a float32 update (optax alone returns it in bfloat16)."""
    rng = np.random.default_rng(SEED + 1)
    params = {"w": jnp.asarray(rng.standard_normal((64, 128)) * 0.5, jnp.bfloat16),
              "b": jnp.asarray(rng.standard_normal(128), jnp.bfloat16)}
    # The momentum dtype named, as the study names it: by default the bfloat16 matrix would get
    # a float16 momentum and its float32 copy a float32 one.
    tx = dion3_jax.dion3(0.03, 0.25, weight_decay=0.1, mu_dtype=jnp.float32)
    view = param_rounding.float32_view(tx)
    state, view_state = tx.init(params), view.init(params)
    for step in range(3):
        grads = {k: jnp.asarray(rng.standard_normal(v.shape) * 0.3, jnp.bfloat16)
                 for k, v in params.items()}
        upd, state = jax.jit(tx.update)(grads, state, params)
        vupd, view_state = jax.jit(view.update)(grads, view_state, params)
        assert upd["w"].dtype == vupd["w"].dtype == jnp.float32
        assert float(jnp.max(jnp.abs(upd["w"]))) > 0
        assert np.array_equal(np.asarray(upd["w"]), np.asarray(vupd["w"])), step
        assert upd["b"].dtype == jnp.bfloat16 and vupd["b"].dtype == jnp.float32
        params = param_rounding.apply_updates(params, upd, "once")


@pytest.mark.slow  # ~30 s of CPU time, mostly compiling two tiny-model steps
def test_tiny_rounding_plan_step():
    """The study's compiled step with ``--plan rounding``'s AdamW runs, tiny model: bfloat16
    params stay bfloat16, and the second step's new params (the first has lr 0 in the
    warm-up) are the once and twice references of its float32 update."""
    import quality_study

    args = quality_study.parse_args(["--tiny", "--plan", "rounding"])
    trainer = quality_study.Trainer(args)
    planner = quality_study.Planner(args.steps, trainer.max_steps)
    names = set(planner.examples("rounding"))
    assert {"dion3@0.25", "normuon bfloat16 once", "adamw bfloat16 twice"} <= names
    runs = {r: planner.rounding_run("adamw", 0, "bfloat16", r) for r in ("once", "twice")}
    make = quality_study._make_tx("adamw", "bfloat16")
    starts, hp = trainer._starts(0), trainer._hp(runs["once"])
    tx = make(runs["once"])
    p0 = trainer.params(0, "bfloat16")
    assert {x.dtype for x in jax.tree.leaves(p0)} == {jnp.dtype(jnp.bfloat16)}
    steps = {r: jax.jit(trainer._step_fn(make(runs[r]), r)) for r in runs}
    p1, s1, _ = steps["once"](p0, tx.init(p0), trainer.train_dev, starts, hp)
    assert all(_same_bits(a, b) for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p0)))
    # The step's float32 update at step 1, computed outside the step.
    g = jax.jit(trainer._grad_fn)(p1, trainer.train_dev, starts, 1)
    hps = dict(s1.hyperparams)
    mult = quality_study._schedule_mult(s1.count, hp["warmup"], hp["total"])
    hps["learning_rate"] = hp["lr"] * mult
    u, _ = jax.jit(tx.update)(g, s1._replace(hyperparams=hps), p1)
    for rounding, reference in (("once", _once), ("twice", _twice)):
        p2, _, _ = steps[rounding](p1, s1, trainer.train_dev, starts, hp)
        for a, w, du in zip(jax.tree.leaves(p2), jax.tree.leaves(p1), jax.tree.leaves(u)):
            assert a.dtype == jnp.bfloat16 and du.dtype == jnp.float32
            assert _same_bits(a, reference(w, du)), rounding
    assert not all(_same_bits(_once(w, du), _twice(w, du))
                   for w, du in zip(jax.tree.leaves(p1), jax.tree.leaves(u)))


def test_rounding_report_is_computed_from_the_runs():
    """The committed ``--plan rounding`` results with fresh random losses: the section's paired
    differences and means follow them."""
    import plan_report
    import rounding_report

    path = os.path.join(os.path.dirname(__file__), "..", "docs", "quality",
                        "h200_rounding.jsonl")
    assert rounding_report.is_rounding_results(path)
    _, runs = plan_report.load([path])
    rng = np.random.default_rng(SEED + 2)
    for r in runs:
        r["final_heldout"] = float(rng.uniform(1, 2))
    groups = rounding_report.by_variant(runs)
    assert len(groups) == 3 and all(len(v) == 3 for v in groups.values())
    for variants in groups.values():
        got = rounding_report.paired(variants, ("bfloat16", "twice"), ("bfloat16", "once"))
        want = [variants[("bfloat16", "twice")][s]["final_heldout"]
                - variants[("bfloat16", "once")][s]["final_heldout"] for s in range(3)]
        assert got == want
    table, _ = rounding_report._tables(groups)
    dion3 = groups[next(k for k in groups if k.startswith("Dion3"))]
    mean = np.mean([r["final_heldout"] for r in dion3[("float32", "once")].values()])
    assert f"{mean:.4f} ± " in table
