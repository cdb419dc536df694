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
"""The section "Past the floor: polar rescaling and 16-bit momentum" of ``docs/QUALITY.md``.

Made from ``--plan floor`` results: ``python examples/quality_study.py --report STUDY.jsonl
FLOOR.jsonl`` puts it after the study's own sections (and after "bf16 parameters: rounding").
Per configuration (f, polar, momentum dtype, parameter dtype) the mean ± sample standard deviation of the final
held-out loss over seeds and the median step time; per candidate, the differences from the
default at the same f and parameter dtype paired by seed (the seed fixes the initialization and the batch order, so
the two runs of a seed differ only in the candidate change), and a verdict: "within the seed
spread" when the mean difference is no larger than the larger of the two configurations' seed
standard deviations, else "ahead" (lower loss) or "behind".
"""

from __future__ import annotations

import collections
import json
import math
import statistics

import numpy as np

import plan_report

TITLE = "## Past the floor: polar rescaling and 16-bit momentum"
#: A configuration: (fraction, polar, momentum dtype, parameter dtype); the defaults' polar and
#: momentum dtype are ("default", "float32").
DEFAULT = ("default", "float32")


def is_floor_results(path: str) -> bool:
    """Whether the results file ``path`` was written by ``--plan floor`` (its meta record's plan,
    or, failing that, a run of the phase "floor")."""
    with open(path) as f:
        for i, line in enumerate(f):
            rec = json.loads(line)
            if i == 0 and rec.get("type") == "meta" and "plan" in rec:
                return rec["plan"] == "floor"
            if rec.get("type") == "run":
                return rec.get("phase") == "floor"
    return False



def config_key(run: dict) -> tuple[float, str, str, str]:
    """A run's configuration; results without the floor fields read as the defaults (and
    float32 parameters)."""
    return (run["fraction"], run.get("polar", "default"), run.get("mu_dtype", "float32"),
            run.get("param_dtype", "float32"))


def by_config(runs: list[dict]) -> dict[tuple, dict[int, dict]]:
    """``{(f, polar, mu_dtype, param_dtype): {seed: run}}``, configurations in first-run
    order."""
    out = collections.OrderedDict()
    for r in runs:
        out.setdefault(config_key(r), {})[r["seed"]] = r
    return out


def candidates(groups: dict) -> list[tuple[tuple, tuple]]:
    """(candidate, its default at the same f and parameter dtype) for every non-default
    configuration run."""
    return [(key, (key[0], *DEFAULT, key[3])) for key in groups if key[1:3] != DEFAULT]


def summary(seeds: dict[int, dict]) -> dict:
    """Mean and sample standard deviation (None below 2 runs) of the held-out loss over seeds,
    the count and the median step milliseconds."""
    xs = [r["final_heldout"] for _, r in sorted(seeds.items())]
    return dict(mean=statistics.fmean(xs) if xs else None, n=len(xs),
                std=statistics.stdev(xs) if len(xs) > 1 else None,
                step_ms=float(np.median([r["step_ms"] for r in seeds.values()])) if xs else None)


def compare(cand: dict[int, dict], base: dict[int, dict]) -> dict:
    """Per-seed ``loss(candidate) − loss(default)`` over the seeds both finished: the
    differences, their mean and sample std, the seeds where the candidate is lower, the seed
    spread (the larger of the two configurations' sample std over those seeds) and the verdict."""
    seeds = [s for s in sorted(cand) if s in base]
    diffs = [cand[s]["final_heldout"] - base[s]["final_heldout"] for s in seeds]
    out = dict(seeds=seeds, diffs=diffs, n=len(diffs), lower=sum(d < 0 for d in diffs),
               mean=statistics.fmean(diffs) if diffs else None,
               std=statistics.stdev(diffs) if len(diffs) > 1 else None, spread=None)
    if len(seeds) < 2:
        out["verdict"] = "not run" if not seeds else "one seed: no spread to compare"
        return out
    out["spread"] = max(summary({s: g[s] for s in seeds})["std"] for g in (cand, base))
    out["verdict"] = ("within the seed spread" if abs(out["mean"]) <= out["spread"]
                      else "ahead" if out["mean"] < 0 else "behind")
    return out


def config_label(key: tuple) -> str:
    """``f = 1/4, norm_bound polar`` and the like."""
    f, polar, mu_dtype, param_dtype = key
    name = "f = 1" if f == 1 else f"f = 1/{round(1 / f)}"
    parts = [name] + ([f"{param_dtype} parameters"] if param_dtype != "float32" else []) \
        + ([f"{polar} polar"] if polar != "default" else []) \
        + ([f"{mu_dtype} momentum"] if mu_dtype != "float32" else [])
    return ", ".join(parts) + (", defaults" if key[1:3] == DEFAULT else "")


def _num(x: float | None, fmt: str = ".4f") -> str:
    return "–" if x is None else format(x, fmt)



def tables(groups: dict) -> tuple[str, str]:
    """The configurations' table and the candidates' table (Markdown)."""
    rows = []
    for key, seeds in groups.items():
        s = summary(seeds)
        per_seed = ", ".join(f"{r['final_heldout']:.4f}" for _, r in sorted(seeds.items()))
        rows.append([config_label(key), f"{_num(s['mean'])} ± {_num(s['std'])} (n={s['n']})",
                     per_seed, _num(s["step_ms"], ".1f")])
    configs = plan_report.table(["configuration", "held-out mean ± std", "per seed", "step ms"],
                                rows)
    rows = []
    for cand, base in candidates(groups):
        c = compare(groups[cand], groups.get(base, {}))
        rows.append([config_label(cand), f"{_num(c['mean'], '+.4f')} ± {_num(c['std'])} "
                     f"(n={c['n']})", f"lower on {c['lower']} of {c['n']} seeds",
                     _num(c["spread"]), c["verdict"]])
    pairs = plan_report.table(["candidate", "candidate − default, per seed", "seeds",
                               "seed spread", "verdict"], rows)
    return configs, pairs


def _rates(runs: list[dict]) -> str:
    """The learning rates, μ rule and weight decay the runs share, read off the first run."""
    if not runs:
        return "the study's best learning rates"
    r = runs[0]
    lr = r["lr"] * math.sqrt(r["fraction"])  # the lr at f = 1 (lr·√f is kept)
    return (f"the study's best learning rates: NorMuon's best lr {lr:.3g} moved to f by "
            f"`dion3_jax.transfer_learning_rate`, μ = `dion3_jax.momentum_for_fraction(f)`, "
            f"weight decay {r['wd']:g}, the AdamW branch at lr {r['adam_lr']:g}")


def _momenta(runs: list[dict]) -> str:
    """The 16-bit momentum dtypes among ``runs``, as their ``mu_dtype=`` arguments."""
    dtypes = sorted({config_key(r)[2] for r in runs} - {"float32"})
    return " or ".join(f"`mu_dtype=jnp.{d}`" for d in dtypes) or "none"


def section(paths: list[str]) -> str:
    """The Markdown section from the ``--plan floor`` results files ``paths``."""
    loaded = [plan_report.load([p], "floor") for p in paths]   # each file's (meta, runs)
    meta = next((m for m, _ in loaded if m is not None), None)
    runs = [r for _, file_runs in loaded for r in file_runs]
    if meta is None:
        raise ValueError(f"no meta record in {paths}")
    configs, pairs = tables(by_config(runs))
    mdl = meta["model"]
    return "\n".join([
        TITLE, "",
        "Generated from " + ", ".join(f"`{p}`" for p in paths) + ". Candidate changes of "
        "Dion3 against its defaults, on the same model, data and "
        f"{meta['steps']}-step schedule as above ({mdl['compute_dtype']} activations, float32 "
        f"parameters unless a row names bfloat16 ones, stored in bfloat16 and updated with one "
        f"rounding, `examples/param_rounding.py`), at {_rates(runs)}. The polars: `norm_bound`, "
        "`orthogonalizer=dion3_jax.make_orthogonalizer(preconditioning=\"norm_bound\")`, the "
        "default coefficients with one scale per matrix read off the first Gram matrix "
        "(`docs/POLAR.md`), and `pe4_bound`, the same rescaling before the 4-step "
        "`coefficients=\"polar_express_4\"` with `restarts=()`, at f = 1 and 1/4. The momentum: "
        + _momenta(runs) + ", rounded "
        "stochastically (`docs/HYPERPARAMETERS.md`), at f = 1/4 and 1/8, each against float32 "
        "momentum with the same parameters. Held-out nats/byte "
        "after the last step, mean ± sample standard deviation over seeds; step ms is the median "
        "over the configuration's runs.", "",
        configs, "",
        "A candidate's difference is paired by seed (the seed fixes the initialization and the "
        "batch order): mean ± sample standard deviation of candidate − default over the seeds "
        "both finished. The verdict is \"within the seed spread\" when the mean difference is no "
        "larger than the seed spread (the larger of the two configurations' standard deviations "
        "over those seeds), else \"ahead\" (lower loss) or \"behind\". The spread is that of "
        "the seeds, not of the differences: a change that is lower on every seed by less than "
        "the spread is within it, and the differences' own standard deviation says how steady "
        "it is.", "",
        pairs, "",
        *_footers(paths, loaded),
    ])


def _footers(paths: list[str], loaded: list[tuple[dict | None, list[dict]]]) -> list[str]:
    """Each results file's command, code, date, machine and count (a later file resumed the
    earlier ones' runs and added its own); ``loaded``: each file's ``(meta, runs)``."""
    lines: list[str] = []
    for path, (meta, runs) in zip(paths, loaded):
        if meta is not None:
            lines += [f"`{path}`:", "", *plan_report.footer(meta, runs), ""]
    return lines[:-1]
