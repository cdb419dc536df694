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
"""The section "bf16 parameters: rounding" of ``docs/QUALITY.md`` from ``--plan rounding`` results.

``python examples/quality_study.py --report STUDY.jsonl ROUNDING.jsonl`` puts it after the
study's own sections: mean ± standard deviation of the final held-out loss over seeds for every
(optimizer, variant), and the per-seed differences between variants (the seed fixes the
initialization and the batch order, so the variants of one seed differ only in how the
parameters are stored).
"""

from __future__ import annotations

import collections
import json
import statistics

import numpy as np

import param_rounding
import plan_report

TITLE = "## bf16 parameters: rounding"


def is_rounding_results(path: str) -> bool:
    """Whether the results file ``path`` was written by ``--plan rounding``."""
    with open(path) as f:
        first = json.loads(f.readline())
    return first.get("type") == "meta" and first.get("plan") == "rounding"



def optimizer_label(run: dict) -> str:
    """The run's configuration without its parameter-storage variant."""
    return run["config"].removesuffix(param_rounding.config_suffix(run))


def by_variant(runs: list[dict]) -> dict[str, dict[tuple[str, str], dict[int, dict]]]:
    """``{optimizer: {(param_dtype, rounding): {seed: run}}}``, optimizers in first-run order."""
    out = collections.OrderedDict()
    for r in runs:
        out.setdefault(optimizer_label(r), {}).setdefault(
            (r["param_dtype"], r["rounding"]), {})[r["seed"]] = r
    return out


def _mean_std(xs: list[float]) -> str:
    if not xs:
        return "not run"
    if len(xs) == 1:
        return f"{xs[0]:.4f} (n=1)"
    return f"{statistics.fmean(xs):.4f} ± {statistics.stdev(xs):.4f} (n={len(xs)})"


def paired(variants: dict, a: tuple[str, str], b: tuple[str, str]) -> list[float]:
    """Per-seed ``loss(a) − loss(b)`` over the seeds that finished both."""
    ra, rb = variants.get(a, {}), variants.get(b, {})
    return [ra[s]["final_heldout"] - rb[s]["final_heldout"] for s in sorted(ra) if s in rb]


def _signed(xs: list[float]) -> str:
    if not xs:
        return "–"
    std = f" ± {statistics.stdev(xs):.4f}" if len(xs) > 1 else ""
    return f"{statistics.fmean(xs):+.4f}{std} (n={len(xs)})"



def _tables(groups: dict) -> tuple[str, str]:
    f32, once, twice = param_rounding.VARIANTS
    names = [param_rounding.variant_name(*v) for v in param_rounding.VARIANTS]
    main, seeds = [], []
    for opt, variants in groups.items():
        loss = lambda v: [r["final_heldout"] for _, r in sorted(variants.get(v, {}).items())]
        main.append([opt, *(_mean_std(loss(v)) for v in param_rounding.VARIANTS),
                     _signed(paired(variants, twice, once)),
                     _signed(paired(variants, once, f32))])
        for v, name in zip(param_rounding.VARIANTS, names):
            runs = [r for _, r in sorted(variants.get(v, {}).items())]
            if runs:
                seeds.append([opt, name, ", ".join(f"{r['final_heldout']:.4f}" for r in runs),
                              f"{np.median([r['step_ms'] for r in runs]):.1f}"])
    header = ["optimizer", *names, "twice − once, per seed", "once − float32, per seed"]
    return (plan_report.table(header, main),
            plan_report.table(["optimizer", "variant", "held-out per seed (0, 1, 2)", "step ms"],
                              seeds))


def section(paths: list[str]) -> str:
    """The Markdown section from the ``--plan rounding`` results files ``paths``."""
    meta, runs = plan_report.load(paths)
    if meta is None:
        raise ValueError(f"no meta record in {paths}")
    main, seeds = _tables(by_variant(runs))
    mdl = meta["model"]
    return "\n".join([
        TITLE, "",
        "Generated from " + ", ".join(f"`{p}`" for p in paths) + ". The same model, data and "
        f"{meta['steps']}-step schedule as above ({mdl['compute_dtype']} activations), with the "
        "parameters stored three ways (`examples/param_rounding.py`): float32 master weights; "
        "bfloat16 parameters to which `optax.apply_updates` adds the float32 update and rounds "
        "once (the library's behavior); bfloat16 parameters to which the update is added after "
        "being rounded to bfloat16 itself (two roundings, as with an optimizer that returns its "
        "update in the parameter's dtype, which also rounds the direction and the decay term "
        "on the way). A bfloat16 model starts from the rounding of the float32 "
        "initialization of the same seed. In both bfloat16 variants every optimizer runs on "
        "float32 copies of the gradients and parameters, so its state and update are float32 "
        "and only the rounding of the update differs. Held-out nats/byte after the last step, "
        "mean ± standard deviation over seeds; a difference column is the mean ± standard "
        "deviation of the per-seed differences.", "",
        main, "", seeds, "",
        *plan_report.footer(meta, runs),
    ])
