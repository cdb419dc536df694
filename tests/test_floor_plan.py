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
"""``quality_study.py --plan floor``: Dion3's norm_bound polar and bfloat16 momentum against the
defaults. The plan's runs and their order, one compiled step per configuration, JSON lines of
the other plans unchanged, and the report's section computed from the runs."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import sys

import numpy as np
import pytest

from seeds import module_seed

pytestmark = pytest.mark.tooling

#: Fresh random losses per run, printed with every test (tests/seeds.py).
SEED = module_seed()

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import floor_report  # noqa: E402
import quality_study  # noqa: E402

CONFIGS = [(1.0, "default", "float32", "float32"), (1.0, "norm_bound", "float32", "float32"),
           (1.0, "pe4_bound", "float32", "float32"),
           (0.25, "default", "float32", "float32"), (0.25, "norm_bound", "float32", "float32"),
           (0.25, "pe4_bound", "float32", "float32"), (0.25, "default", "bfloat16", "float32"),
           (0.25, "default", "float16", "float32"),
           (0.125, "default", "float32", "float32"), (0.125, "default", "bfloat16", "float32"),
           (0.125, "default", "float16", "float32"),
           (0.25, "default", "float32", "bfloat16"), (0.25, "default", "float16", "bfloat16"),
           (0.125, "default", "float32", "bfloat16"), (0.125, "default", "float16", "bfloat16")]
N = len(CONFIGS)


def _floor_runs(planner) -> list:
    return [run for _, plan in planner.phases("floor") for run in plan()]


def test_floor_plan_is_every_configuration_seed_by_seed():
    import dion3_jax

    planner = quality_study.Planner(300, 599)
    runs = _floor_runs(planner)
    assert len(runs) == 3 * N and len({r.key() for r in runs}) == 3 * N
    assert [r.seed for r in runs] == [0] * N + [1] * N + [2] * N
    for seed in range(3):
        assert [(r.fraction, r.polar, r.mu_dtype, r.param_dtype)
                for r in runs[N * seed:N * seed + N]] == CONFIGS
    for r in runs:  # Planner.rounding_run's Dion3 run, at every f
        f = r.fraction
        assert (r.opt, r.phase, r.steps, r.rounding) == ("dion3", "floor", 300, "once")
        assert math.isclose(r.lr, 0.04 / math.sqrt(f))
        assert math.isclose(r.lr, dion3_jax.transfer_learning_rate(0.04, 1.0, f))
        assert math.isclose(r.mu, dion3_jax.momentum_for_fraction(f)) and r.mu_rule == "pow"
        assert (r.wd, r.adam_lr) == (0.01, 2e-3)
    ref = planner.rounding_run("dion3", 1, "float32", "once")
    same = next(r for r in runs if (r.fraction, r.polar, r.mu_dtype, r.param_dtype, r.seed) == (
        0.25, "default", "float32", "float32", 1))
    assert dataclasses.replace(same, phase="rounding") == ref
    same = next(r for r in runs if (r.fraction, r.polar, r.mu_dtype, r.param_dtype, r.seed) == (
        0.25, "default", "float32", "bfloat16", 1))
    assert dataclasses.replace(same, phase="rounding") == planner.rounding_run(
        "dion3", 1, "bfloat16", "once")
    # --seeds cuts the plan to its first seeds.
    assert len(_floor_runs(quality_study.Planner(300, 599, seeds=2))) == 2 * N


def test_floor_configurations_are_distinct_compiled_steps():
    planner = quality_study.Planner(300, 599)
    examples = planner.examples("floor")
    assert len(examples) == N
    assert sorted((r.fraction, r.polar, r.mu_dtype, r.param_dtype)
                  for r in examples.values()) == sorted(CONFIGS)
    assert set(examples) == {"dion3@1", "dion3@1 polar norm_bound", "dion3@1 polar pe4_bound",
                             "dion3@0.25", "dion3@0.25 polar norm_bound",
                             "dion3@0.25 polar pe4_bound", "dion3@0.25 momentum bfloat16",
                             "dion3@0.25 momentum float16", "dion3@0.125",
                             "dion3@0.125 momentum bfloat16", "dion3@0.125 momentum float16",
                             "dion3@0.25 bfloat16 once", "dion3@0.25 bfloat16 once momentum float16",
                             "dion3@0.125 bfloat16 once",
                             "dion3@0.125 bfloat16 once momentum float16"}
    names = {quality_study.config_name(r.record()) for r in examples.values()}
    assert len(names) == N
    assert "Dion3 f=1/4 μ 0.8145 lr 0.08 wd 0.01, norm_bound polar" in names
    assert "Dion3 f=1/8 μ 0.6634 lr 0.113 wd 0.01, bfloat16 momentum" in names
    # The other plans' step names and JSON lines are as before the floor fields existed.
    assert set(planner.examples("rounding")) >= {"dion3@0.25", "adamw bfloat16 twice"}
    run = planner.rounding_run("dion3", 0, "bfloat16", "once")
    assert run.step_name == "dion3@0.25 bfloat16 once"
    assert "polar" not in run.record() and "mu_dtype" not in run.record()
    floor = planner.floor_run(0.25, "norm_bound", "float32", 0).record()
    assert floor["polar"] == "norm_bound" and "mu_dtype" not in floor


def test_a_resumed_fixed_plan_compiles_only_the_steps_of_runs_still_to_do():
    """``--resume`` with every seed of some configurations finished: ``examples`` (what
    ``study`` compiles) leaves their steps out and keeps those with a run still to do; the
    adaptive study plan, whose later runs depend on earlier results, keeps all its steps."""
    planner = quality_study.Planner(300, 599)
    runs = _floor_runs(planner)
    done = {"dion3@1", "dion3@0.25 momentum float16"}
    for run in runs:
        if run.step_name in done or (run.step_name == "dion3@0.125" and run.seed < 2):
            planner.record(run, dict(final_heldout=1.0, step_ms=1.0))
    assert set(planner.examples("floor")) == {r.step_name for r in runs} - done
    planner = quality_study.Planner(300, 599)  # the rounding plan, on its own
    everything = set(planner.examples("rounding"))
    rounding = [run for _, make in planner.phases("rounding") for run in make()]
    for run in rounding:
        if run.step_name == "adamw bfloat16 twice":
            planner.record(run, dict(final_heldout=1.0, step_ms=1.0))
    assert set(planner.examples("rounding")) == everything - {"adamw bfloat16 twice"}
    for run in rounding:
        planner.record(run, dict(final_heldout=1.0, step_ms=1.0))
    assert planner.examples("rounding") == {}
    assert planner.examples("study").keys() == quality_study.Planner(300, 599).examples(
        "study").keys()


def test_floor_options_reach_dion3():
    """The candidate's options are static arguments of dion3 (not schedules), the defaults
    pass none, and the other optimizers refuse them."""
    import jax
    import jax.numpy as jnp

    import dion3_jax

    opts = quality_study._dion3_options("norm_bound", "bfloat16")
    assert opts["orthogonalizer"] == dion3_jax.make_orthogonalizer(preconditioning="norm_bound")
    assert opts["mu_dtype"] == jnp.bfloat16
    assert quality_study._dion3_options("default", "float32") == {}
    planner = quality_study.Planner(300, 599)
    params = {"w": jnp.zeros((8, 16), jnp.float32)}
    for mu_dtype in ("float32", "bfloat16"):
        run = planner.floor_run(0.25, "default", mu_dtype, 0)
        state = quality_study._make_tx(run.family, mu_dtype=mu_dtype)(run).init(params)
        dtypes = {x.dtype for x in jax.tree.leaves(state) if x.shape == (8, 16)}
        assert jnp.dtype(mu_dtype) in dtypes, (mu_dtype, dtypes)  # the momentum
        assert (jnp.dtype(jnp.bfloat16) in dtypes) == (mu_dtype == "bfloat16"), dtypes
    with pytest.raises(ValueError, match="'norm_bound'.*normuon takes only the defaults"):
        quality_study._make_base_tx("normuon", "norm_bound")


def test_old_result_lines_load_with_the_default_floor_fields(tmp_path):
    """A results file written before the floor fields existed loads; its runs are the defaults."""
    planner = quality_study.Planner(300, 599)
    path = os.path.join(ROOT, "docs", "quality", "h200_rounding.jsonl")
    assert quality_study.load_runs(path, planner) == 27
    assert all(k[-2:] == ("default", "float32") for k in planner.results)
    assert planner.rounding_run("dion3", 2, "bfloat16", "twice").key() in planner.results
    with open(path) as f:
        run = next(json.loads(line) for line in f if '"run"' in line)
    assert floor_report.config_key(run) == (0.25, "default", "float32", "float32")
    assert not floor_report.is_floor_results(path)


def _fake_runs(rng, seeds=(0, 1, 2)) -> list[dict]:
    return [dict(type="run", phase="floor", fraction=f, polar=p, mu_dtype=m, param_dtype=d,
                 seed=s, final_heldout=float(rng.uniform(1.0, 1.2)), step_ms=float(rng.uniform(5, 15)))
            for s in seeds for f, p, m, d in CONFIGS]


def test_report_arithmetic_on_hand_made_runs():
    rng = np.random.default_rng(SEED)
    runs = _fake_runs(rng)
    groups = floor_report.by_config(runs)
    assert list(groups) == CONFIGS
    pairs = floor_report.candidates(groups)
    assert pairs == [(c, (c[0], "default", "float32", c[3])) for c in CONFIGS
                     if c[1:3] != ("default", "float32")]
    loss = {(r["fraction"], r["polar"], r["mu_dtype"], r["param_dtype"], r["seed"]):
            r["final_heldout"] for r in runs}
    for key, seeds in groups.items():
        xs = [loss[(*key, s)] for s in range(3)]
        s = floor_report.summary(seeds)
        assert s["n"] == 3 and math.isclose(s["mean"], sum(xs) / 3, rel_tol=1e-12)
        var = sum((x - sum(xs) / 3) ** 2 for x in xs) / 2  # sample variance
        assert math.isclose(s["std"], math.sqrt(var), rel_tol=1e-9)
        ms = sorted(r["step_ms"] for r in runs if floor_report.config_key(r) == key)
        assert s["step_ms"] == ms[1]
    for cand, base in pairs:
        d = [loss[(*cand, s)] - loss[(*base, s)] for s in range(3)]
        c = floor_report.compare(groups[cand], groups[base])
        mean = sum(d) / 3
        assert c["n"] == 3 and math.isclose(c["mean"], mean, rel_tol=1e-9, abs_tol=1e-12)
        assert math.isclose(c["std"], math.sqrt(sum((x - mean) ** 2 for x in d) / 2),
                            rel_tol=1e-9)
        assert c["lower"] == sum(x < 0 for x in d)
        spread = max(statistics.stdev([loss[(*k, s)] for s in range(3)]) for k in (cand, base))
        assert math.isclose(c["spread"], spread, rel_tol=1e-12)
        want = ("within the seed spread" if abs(mean) <= spread else
                "ahead" if mean < 0 else "behind")
        assert c["verdict"] == want


def test_report_verdicts_and_missing_seeds():
    base = {s: dict(final_heldout=1.0 + 0.01 * s, step_ms=1.0) for s in range(3)}
    std = statistics.stdev([1.0, 1.01, 1.02])
    shift = lambda d: {s: dict(r, final_heldout=r["final_heldout"] + d) for s, r in base.items()}
    assert floor_report.compare(shift(-2 * std), base)["verdict"] == "ahead"
    assert floor_report.compare(shift(2 * std), base)["verdict"] == "behind"
    within = floor_report.compare(shift(0.5 * std), base)
    assert within["verdict"] == "within the seed spread" and within["lower"] == 0
    # Only the seeds both finished are paired; one seed has no spread to compare.
    partial = floor_report.compare({0: base[0], 2: base[2]}, base)
    assert partial["seeds"] == [0, 2] and partial["n"] == 2
    assert floor_report.compare({1: base[1]}, base)["verdict"] == "one seed: no spread to compare"
    assert floor_report.compare({}, base)["verdict"] == "not run"


def _rows(section: str, first: str) -> dict[str, list[str]]:
    """The rows of the Markdown table whose header starts with ``first``, by first cell."""
    lines = section.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first} |"))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


#: The end-to-end test's configurations: each kind of candidate once (a polar with and without
#: restarts, a 16-bit momentum with bfloat16 parameters) beside its defaults; the planner's own
#: list is tested above.
SUBSET = ((1.0, "default", "float32", "float32"), (1.0, "pe4_bound", "float32", "float32"),
          (0.25, "default", "float32", "float32"), (0.25, "norm_bound", "float32", "float32"),
          (0.25, "default", "float32", "bfloat16"), (0.25, "default", "float16", "bfloat16"))


@pytest.mark.slow  # ~25-35 s on two CPU cores: compiles 6 Dion3 steps of the tiny model
def test_tiny_floor_plan_end_to_end(tmp_path, monkeypatch):
    """``--plan floor --tiny --seeds 2`` trains each configuration (a subset of the plan's, one
    candidate of each kind) for real on the CPU, and ``--report`` on its lines writes the
    section with the differences of those lines."""
    monkeypatch.setattr(quality_study.Planner, "FLOOR_CONFIGS", SUBSET)
    configs_run, n = list(SUBSET), len(SUBSET)
    out = tmp_path / "floor.jsonl"
    quality_study.main(["--plan", "floor", "--tiny", "--seeds", "2", "--out", str(out)])
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert recs[0]["type"] == "meta" and recs[0]["plan"] == "floor"
    runs = [r for r in recs if r["type"] == "run"]
    assert [r["seed"] for r in runs] == [0] * n + [1] * n
    assert [floor_report.config_key(r) for r in runs[:n]] == configs_run
    assert all(math.isfinite(r["final_heldout"]) for r in runs)
    # The steps, an evaluation per parameter dtype and the grad.
    assert len(set(recs[1]["compile_s"])) == n + 2 + 1

    doc = tmp_path / "QUALITY.md"
    study = os.path.join(ROOT, "docs", "quality", "h200_results.jsonl")
    quality_study.main(["--report", study, str(out), "--doc", str(doc), "--plots",
                        str(tmp_path), "--command", "c"])
    text = doc.read_text()
    assert text.count(floor_report.TITLE) == 1
    section = text[text.index(floor_report.TITLE):]
    loss = {(*floor_report.config_key(r), r["seed"]): r["final_heldout"] for r in runs}
    configs = _rows(section, "configuration")
    assert len(configs) == n
    for key in configs_run:
        xs = [loss[(*key, s)] for s in (0, 1)]
        cells = configs[floor_report.config_label(key)]
        assert cells[0] == f"{np.mean(xs):.4f} ± {np.std(xs, ddof=1):.4f} (n=2)"
        assert cells[1] == ", ".join(f"{x:.4f}" for x in xs)
    pairs = _rows(section, "candidate")
    assert len(pairs) == n - 3
    for key in configs_run:
        if key[1:3] == ("default", "float32"):
            continue
        base = (key[0], "default", "float32", key[3])
        d = [loss[(*key, s)] - loss[(*base, s)] for s in (0, 1)]
        cells = pairs[floor_report.config_label(key)]
        assert cells[0] == f"{np.mean(d):+.4f} ± {np.std(d, ddof=1):.4f} (n=2)"
        assert cells[1] == f"lower on {sum(x < 0 for x in d)} of 2 seeds"
        spread = max(np.std([loss[(*k, s)] for s in (0, 1)], ddof=1) for k in (key, base))
        assert cells[2] == f"{spread:.4f}"
        assert cells[3] == ("within the seed spread" if abs(np.mean(d)) <= spread else
                            "ahead" if np.mean(d) < 0 else "behind")


def test_floor_flags(capsys):
    args = quality_study.parse_args(["--plan", "floor", "--seeds", "2"])
    assert (args.plan, args.seeds, args.param_dtype) == ("floor", 2, "float32")
    for argv, message in ((["--plan", "floor", "--param-dtype", "bfloat16"], "pass neither"),
                          (["--plan", "floor", "--seeds", "0"], "--seeds: 0 is outside"),
                          (["--seeds", "2"], "--seeds is for the fixed plans")):
        with pytest.raises(SystemExit) as e:
            quality_study.parse_args(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err, argv


def test_floor_results_resume(tmp_path):
    """``--resume`` reads the floor fields back: every finished floor run is found again."""
    planner = quality_study.Planner(300, 599)
    runs = _floor_runs(planner)[:9]
    path = tmp_path / "floor.jsonl"
    lines = [dict(type="meta", plan="floor")] + [
        dict(type="run", **r.record(), final_heldout=1.0, step_ms=1.0) for r in runs]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    fresh = quality_study.Planner(300, 599)
    assert quality_study.load_runs(str(path), fresh) == 9
    assert set(fresh.results) == {r.key() for r in runs}
    assert floor_report.is_floor_results(str(path))
