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
"""Quality study: does Dion3 train as well as NorMuon and AdamW? One command, one GPU.

Trains the main job's model family (``examples/train_lm.py``: a byte-level Flax NNX transformer on
the Python standard library's sources, fixed held-out split by a hash of each file's path) with
AdamW, NorMuon (``dion3_jax.normuon``, f = 1) and Dion3 at f = 1/2, 1/4, 1/8, and writes one
JSON line per finished run, so a run stopped at a time limit keeps what it finished.

The runs are queued by priority and planned phase by phase from the results so far:

1. the headline: an AdamW learning-rate sweep, a NorMuon learning-rate sweep, Dion3 at f = 1/4
   with μ = 0.95 and μ = 0.95^(1/f) at the NorMuon learning rate moved by the paper's rule
   (``lr·√f`` fixed, ``dion3_jax.transfer_learning_rate``), then seeds 1 and 2 of each;
2. Dion3 at f = 1/2 and 1/8 (both μ rules); AdamW and NorMuon at Dion3 f = 1/4's measured time
   ("equal optimizer time": step counts scaled by the measured step times); more seeds;
3. a learning-rate × f grid around the transferred rate (tests the √f rule) and two weight-decay
   rules (constant, and ``wd·√f``, which keeps the per-step decay ``lr·wd`` the same for every f).

The parameters are float32 and the activations bfloat16 unless ``--param-dtype bfloat16``
stores the parameters in bfloat16 (``--rounding`` then says how the update is added:
``examples/param_rounding.py``). ``--plan rounding`` runs another, fixed plan instead: Dion3
f = 1/4, NorMuon and AdamW at the study's best learning rates, each with float32 master weights
and with bfloat16 parameters rounded once and twice, three seeds each. ``--plan floor`` tests
candidate changes of Dion3 against its defaults at the same learning rates, three seeds each:
two polars (``POLARS``: ``preconditioning="norm_bound"``, and the 4-step ``polar_express_4``
after it with no restart; ``docs/POLAR.md``) at f = 1 and 1/4, and bfloat16 and float16
momenta (``mu_dtype``, rounded stochastically) at f = 1/4 and 1/8, and float16 momentum with
bfloat16 parameters (updates rounded once) beside float32 momentum with them; every
configuration's seed 0 runs first, then the seeds 1, then 2 (``--seeds`` cuts them).

Every optimizer config is compiled once, ahead of time and in parallel: the learning rate, μ and
weight decay live in the optimizer state (``optax.inject_hyperparams``; ``fraction``, the polar
and the momentum dtype are static), and the warm-up + cosine schedule is computed inside the step
from the step counter.

Usage::

    python examples/quality_study.py --tiny --out runs/quality/tiny.jsonl   # CPU check, ~1 min
    python examples/quality_study.py --out runs/quality/results.jsonl      # one H200, ~5 min
    python examples/quality_study.py --report runs/quality/results.jsonl   # docs/QUALITY.md
    python examples/quality_study.py --plan rounding --out runs/quality/rounding.jsonl
    python examples/quality_study.py --plan floor --out runs/quality/floor.jsonl  # 45 runs

``--report`` needs no accelerator: it reads the JSON lines and writes ``docs/QUALITY.md`` and the
plots under ``docs/quality/``; results of ``--plan rounding`` (given among the files) become the
section "bf16 parameters: rounding" (``examples/rounding_report.py``), and those of ``--plan
floor`` the section "Past the floor: polar rescaling and 16-bit momentum"
(``examples/floor_report.py``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import importlib.util
import json
import math
import os
import platform
import sys
import time

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)  # train_lm, the main job's model and data

import param_rounding  # noqa: E402

MU_RULES = ("const", "pow")  # μ = 0.95, or μ = 0.95^(1/f)
WD_RULES = ("const", "sqrt_f")  # wd, or wd·√f
FRACTIONS = (0.5, 0.25, 0.125)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The study's flags (every one validated before any data is read)."""
    import _common
    import param_rounding
    import quality_report

    p = _common.make_parser(__doc__)
    p.add_argument("--out", default="runs/quality/results.jsonl",
                   help="JSON-lines file the runs are appended to (a new file each time)")
    p.add_argument("--report", metavar="JSONL", nargs="+", default=None,
                   help="write the doc and plots from these results files instead of training "
                        "(examples/quality_report.py)")
    quality_report.add_report_flags(p, prefix="--report: ")
    p.add_argument("--resume", metavar="JSONL", nargs="+", default=None,
                   help="results of earlier calls: their finished runs are not run again (the "
                        "plan continues from them; the fixed plans compile only the steps of "
                        "runs still to do); new runs go to --out")
    p.add_argument("--tiny", action="store_true",
                   help="tiny model and runs, for a CPU check of the whole pipeline")
    p.add_argument("--steps", type=_common.positive_int, default=300,
                   help="steps of every equal-step run")
    p.add_argument("--d-model", type=_common.positive_int, default=512, help="model width")
    p.add_argument("--layers", type=_common.positive_int, default=8, help="transformer blocks")
    p.add_argument("--heads", type=_common.positive_int, default=8, help="attention heads")
    p.add_argument("--seq-len", type=_common.positive_int, default=512,
                   help="context length in bytes")
    p.add_argument("--batch", type=_common.positive_int, default=32, help="sequences per step")
    p.add_argument("--plan", default="study", choices=["study", "rounding", "floor"],
                   help="study: the adaptive plan of the three phases; rounding: every optimizer "
                        "under the three parameter-storage variants of examples/param_rounding.py;"
                        " floor: Dion3's candidate polars and 16-bit momenta against its "
                        "defaults")
    p.add_argument("--seeds", type=_common.positive_int, default=3,
                   help="seeds 0, 1, ... of every configuration (--plan rounding and floor)")
    p.add_argument("--compute-dtype", default="bfloat16", choices=["float32", "bfloat16"],
                   help="activation dtype")
    p.add_argument("--param-dtype", default="float32", choices=list(param_rounding.PARAM_DTYPES),
                   help="dtype the parameters are stored in (--plan study)")
    p.add_argument("--rounding", default="once", choices=list(param_rounding.ROUNDINGS),
                   help="16-bit parameters: add the float32 update and round once, or round the "
                        "update to the parameter dtype first (--plan study)")
    p.add_argument("--data-mb", type=_common.positive_float, default=12.0,
                   help="cap on the stdlib text read (MB)")
    p.add_argument("--heldout-percent", type=_common.percent, default=5.0,
                   help="percent of files (by path hash) held out")
    p.add_argument("--eval-every", type=_common.positive_int, default=50,
                   help="steps between held-out evaluations")
    p.add_argument("--eval-batches", type=_common.positive_int, default=16,
                   help="held-out batches per evaluation")
    p.add_argument("--time-budget", type=_common.positive_float, default=540.0,
                   help="seconds from start after which no new run is started")
    p.add_argument("--compile-workers", type=_common.positive_int, default=8,
                   help="threads compiling the optimizer configs ahead of time")
    p.add_argument("--tag", default="", help="free text stored with the results (e.g. a commit)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parses and validates the flags; errors exit through argparse before anything loads."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.tiny:
        args.d_model, args.layers, args.heads, args.seq_len, args.batch = 32, 1, 2, 32, 4
        args.steps, args.eval_every, args.eval_batches, args.data_mb = 24, 8, 2, 1.0
        args.compute_dtype = "float32"
    if args.rounding == "twice" and args.param_dtype == "float32":
        p.error("--rounding twice rounds the update to the parameter dtype: it needs "
                "--param-dtype bfloat16")
    if args.plan == "rounding" and (args.param_dtype, args.rounding) != ("float32", "once"):
        p.error("--plan rounding runs every --param-dtype and --rounding itself: pass neither")
    if args.plan == "floor" and (args.param_dtype, args.rounding) != ("float32", "once"):
        p.error("--plan floor sets the parameters' dtype per run: pass neither --param-dtype nor "
                "--rounding")
    if args.plan == "study" and args.seeds != 3:
        p.error("--seeds is for the fixed plans (--plan rounding, floor); the study plans its "
                "own seeds")
    if args.d_model % args.heads or (args.d_model // args.heads) % 2:
        p.error(f"--d-model must be --heads × an even head size, got {args.d_model}, {args.heads}")
    for flag in ("report", "resume", "notes"):
        paths = getattr(args, flag)
        for path in [paths] if isinstance(paths, str) else paths or []:
            if not os.path.isfile(path):
                p.error(f"--{flag}: no such file {path!r}")
    return args


# ---------------------------------------------------------------------------------------------
# Run specifications and planning
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run. ``family`` picks the compiled step: adamw, normuon or dion3@f."""

    phase: str
    opt: str  # "adamw", "normuon" or "dion3"
    lr: float
    seed: int
    steps: int
    fraction: float = 1.0
    mu: float = 0.95
    mu_rule: str = "const"
    wd: float = 0.1
    wd_rule: str = "const"
    adam_lr: float = 0.0  # lr of the AdamW branch of NorMuon / Dion3
    lr_mult: float = 1.0  # lr / transferred lr (Dion3 grid)
    param_dtype: str = "float32"  # examples/param_rounding.py
    rounding: str = "once"
    polar: str = "default"  # Dion3's polar: "default" or a preconditioning (--plan floor)
    mu_dtype: str = "float32"  # Dion3's momentum dtype (--plan floor)

    @property
    def family(self) -> str:
        return f"dion3@{self.fraction:g}" if self.opt == "dion3" else self.opt

    @property
    def step_name(self) -> str:
        """The compiled step: the family, then the parameter storage unless float32, the polar
        unless the default and the momentum dtype unless float32."""
        name = self.family
        if self.param_dtype != "float32":
            name += f" {self.param_dtype} {self.rounding}"
        if self.polar != "default":
            name += f" polar {self.polar}"
        if self.mu_dtype != "float32":
            name += f" momentum {self.mu_dtype}"
        return name

    def key(self) -> tuple:
        return (self.opt, self.fraction, round(self.mu, 6), round(self.lr, 9), round(self.wd, 9),
                round(self.adam_lr, 9), self.steps, self.seed, self.param_dtype, self.rounding,
                self.polar, self.mu_dtype)

    def record(self) -> dict:
        """The run's fields for a JSON line; the Dion3 options of ``--plan floor`` only where they
        differ from the defaults (so the other plans' lines stay as they were)."""
        rec = dataclasses.asdict(self)
        for f in FLOOR_FIELDS:
            if rec[f.name] == f.default:
                del rec[f.name]
        return rec


#: The fields of --plan floor, left out of a run's JSON line at their defaults.
FLOOR_FIELDS = tuple(f for f in dataclasses.fields(Run) if f.name in ("polar", "mu_dtype"))


def config_name(r: dict) -> str:
    """A readable name of a run's configuration (everything but the seed)."""
    return _optimizer_name(r) + param_rounding.config_suffix(r) + _floor_suffix(r)


def _floor_suffix(r: dict) -> str:
    """What a name adds for a non-default polar or momentum dtype ("" for the defaults)."""
    polar, mu_dtype = r.get("polar", "default"), r.get("mu_dtype", "float32")
    return ((f", {polar} polar" if polar != "default" else "")
            + (f", {mu_dtype} momentum" if mu_dtype != "float32" else ""))


def _optimizer_name(r: dict) -> str:
    if r["opt"] == "adamw":
        return f"AdamW lr {r['lr']:.3g}" + (f", {r['steps']} steps" if r["phase"] == "time" else "")
    if r["opt"] == "normuon":
        s = f"NorMuon lr {r['lr']:.3g}, wd {r['wd']:g}"
        return s + (f", {r['steps']} steps" if r["phase"] == "time" else "")
    f = "1" if r["fraction"] == 1 else f"1/{round(1 / r['fraction'])}"
    return (f"Dion3 f={f} μ {r['mu']:.4g} lr {r['lr']:.3g} "
            f"wd {r['wd']:.3g}")


class Planner:
    """Yields the study's runs phase by phase; later phases read earlier results."""

    ADAMW_LRS = (1e-3, 2e-3, 4e-3, 8e-3)
    NORMUON_LRS = (0.01, 0.02, 0.04)
    ADAMW_WD, MATRIX_WD, BIG_WD = 0.1, 0.01, 0.1
    #: The best peak learning rates of the study's sweeps (docs/QUALITY.md), for --plan rounding.
    BEST_ADAMW_LR, BEST_NORMUON_LR = 2e-3, 0.04
    ROUNDING_OPTS = ("dion3", "normuon", "adamw")
    #: --plan floor: Dion3's (f, polar, momentum dtype, parameter dtype), each candidate beside
    #: its default (the defaults' polar and momentum, same f and parameter dtype).
    FLOOR_CONFIGS = ((1.0, "default", "float32", "float32"),
                     (1.0, "norm_bound", "float32", "float32"),
                     (1.0, "pe4_bound", "float32", "float32"),
                     (0.25, "default", "float32", "float32"),
                     (0.25, "norm_bound", "float32", "float32"),
                     (0.25, "pe4_bound", "float32", "float32"),
                     (0.25, "default", "bfloat16", "float32"),
                     (0.25, "default", "float16", "float32"),
                     (0.125, "default", "float32", "float32"),
                     (0.125, "default", "bfloat16", "float32"),
                     (0.125, "default", "float16", "float32"),
                     (0.25, "default", "float32", "bfloat16"),
                     (0.25, "default", "float16", "bfloat16"),
                     (0.125, "default", "float32", "bfloat16"),
                     (0.125, "default", "float16", "bfloat16"))

    def __init__(self, steps: int, max_steps: int, param_dtype: str = "float32",
                 rounding: str = "once", seeds: int = 3):
        self.steps, self.max_steps, self.seeds = steps, max_steps, seeds
        self.storage = dict(param_dtype=param_dtype, rounding=rounding)  # of the study's runs
        self.results: dict[tuple, dict] = {}
        self.step_ms: dict[str, float] = {}  # the first measured (equal-time runs use it)
        self.last_ms: dict[str, float] = {}  # the latest measured (time-budget guesses use it)

    # -- helpers reading the results so far ---------------------------------------------------

    def record(self, run: Run, result: dict) -> None:
        self.results[run.key()] = result
        self.step_ms.setdefault(run.family, result["step_ms"])
        self.last_ms[run.step_name] = result["step_ms"]

    def _loss(self, run: Run) -> float:
        r = self.results.get(run.key())
        return r["final_heldout"] if r and math.isfinite(r["final_heldout"]) else math.inf

    def _best_lr(self, make, lrs) -> float:
        return min(lrs, key=lambda lr: self._loss(make(lr, 0)))

    def _extend(self, make, lrs):
        """The sweep's best lr; one more point beyond the grid if the best is at an edge."""
        best = self._best_lr(make, lrs)
        if best == lrs[0]:
            yield make(lrs[0] / 2, 0)
        elif best == lrs[-1]:
            yield make(lrs[-1] * 2, 0)

    def adamw(self, lr, seed, steps=None, phase="adamw"):
        return Run(phase, "adamw", lr, seed, steps or self.steps, wd=self.ADAMW_WD,
                   **self.storage)

    def normuon(self, lr, seed, steps=None, phase="normuon", wd=None):
        return Run(phase, "normuon", lr, seed, steps or self.steps,
                   wd=self.MATRIX_WD if wd is None else wd, adam_lr=self.adam_best(),
                   **self.storage)

    def dion3(self, f, mu_rule, seed, lr_mult=1.0, wd_rule="const", base_wd=None, phase="dion3"):
        import dion3_jax

        lr = dion3_jax.transfer_learning_rate(self.normuon_best(), 1.0, f) * lr_mult
        mu = 0.95 if mu_rule == "const" else 0.95 ** (1 / f)
        wd = self.MATRIX_WD if base_wd is None else base_wd
        wd = wd * math.sqrt(f) if wd_rule == "sqrt_f" else wd
        return Run(phase, "dion3", lr, seed, self.steps, f, mu, mu_rule, wd, wd_rule,
                   self.adam_best(), lr_mult, **self.storage)

    def rounding_run(self, opt: str, seed: int, param_dtype: str, rounding: str) -> Run:
        """A run of --plan rounding: ``opt`` at the study's best learning rate (Dion3: f = 1/4,
        the library's μ = 0.95^(1/f), NorMuon's best lr moved by the √f rule)."""
        import dion3_jax

        storage = dict(param_dtype=param_dtype, rounding=rounding)
        adam_lr, matrix_lr = self.BEST_ADAMW_LR, self.BEST_NORMUON_LR
        if opt == "adamw":
            return Run("rounding", "adamw", adam_lr, seed, self.steps, wd=self.ADAMW_WD,
                       **storage)
        if opt == "normuon":
            return Run("rounding", "normuon", matrix_lr, seed, self.steps, wd=self.MATRIX_WD,
                       adam_lr=adam_lr, **storage)
        f = 0.25
        return Run("rounding", "dion3", dion3_jax.transfer_learning_rate(matrix_lr, 1.0, f),
                   seed, self.steps, f, dion3_jax.momentum_for_fraction(f), "pow",
                   self.MATRIX_WD, adam_lr=adam_lr, **storage)

    def floor_run(self, fraction: float, polar: str, mu_dtype: str, seed: int,
                  param_dtype: str = "float32") -> Run:
        """A run of --plan floor: Dion3 at ``fraction`` as :meth:`rounding_run` builds it
        (parameters stored in ``param_dtype``, updates rounded once), with the polar's
        ``preconditioning`` (``"default"``: the library's default orthogonalizer) and the
        momentum dtype ``mu_dtype``."""
        import dion3_jax

        return Run("floor", "dion3",
                   dion3_jax.transfer_learning_rate(self.BEST_NORMUON_LR, 1.0, fraction), seed,
                   self.steps, fraction, dion3_jax.momentum_for_fraction(fraction), "pow",
                   self.MATRIX_WD, adam_lr=self.BEST_ADAMW_LR, param_dtype=param_dtype,
                   polar=polar, mu_dtype=mu_dtype)

    def floor_config_run(self, config: tuple, seed: int) -> Run:
        """:meth:`floor_run` of one of :data:`FLOOR_CONFIGS`."""
        fraction, polar, mu_dtype, param_dtype = config
        return self.floor_run(fraction, polar, mu_dtype, seed, param_dtype)

    def examples(self, plan: str) -> dict[str, Run]:
        """One run per compiled step of ``plan``, by step name (their values are set per run).
        The fixed plans (``rounding``, ``floor``) name only the steps that a run still to do
        needs, so a resumed call compiles no step whose runs are all finished."""
        if plan == "rounding":
            runs = [self.rounding_run(opt, 0, *v) for opt in self.ROUNDING_OPTS
                    for v in param_rounding.VARIANTS]
        elif plan == "floor":
            runs = [self.floor_config_run(c, 0) for c in self.FLOOR_CONFIGS]
        else:
            runs = [self.adamw(1e-3, 0), self.normuon(0.02, 0)]
            runs += [Run("x", "dion3", 0.04, 0, self.steps, f, adam_lr=1e-3, **self.storage)
                     for f in FRACTIONS]
            return {run.step_name: run for run in runs}
        todo = {run.step_name for _, make in self.phases(plan) for run in make()
                if run.key() not in self.results}
        return {run.step_name: run for run in runs if run.step_name in todo}

    def adam_best(self) -> float:
        return self._best_lr(self.adamw, self.ADAMW_LRS + (5e-4, 1.6e-2))

    def normuon_best(self) -> float:
        return self._best_lr(self.normuon, self.NORMUON_LRS + (0.005, 0.08))

    def mu_best(self) -> str:
        """The μ rule with the lower mean held-out loss at f = 1/4 (the headline pair), over
        the seeds finished for both rules (a rule with none loses)."""
        seeds = [s for s in range(3)
                 if all(math.isfinite(self._loss(self.dion3(0.25, m, s))) for m in MU_RULES)]
        if not seeds:
            return MU_RULES[0]
        return min(MU_RULES, key=lambda m: sum(self._loss(self.dion3(0.25, m, s))
                                               for s in seeds))

    # -- the phases, in priority order -----------------------------------------------------

    def phases(self, plan: str = "study"):
        """(phase name, a function returning its runs), in priority order."""
        if plan == "rounding":
            for seed in range(self.seeds):
                yield f"rounding seed {seed}", lambda seed=seed: [
                    self.rounding_run(opt, seed, *v) for opt in self.ROUNDING_OPTS
                    for v in param_rounding.VARIANTS]
            return
        if plan == "floor":  # every configuration's seed 0 first: a time limit keeps seeds
            for seed in range(self.seeds):
                yield f"floor seed {seed}", lambda seed=seed: [
                    self.floor_config_run(c, seed) for c in self.FLOOR_CONFIGS]
            return
        yield "adamw lr sweep", lambda: [self.adamw(lr, 0) for lr in self.ADAMW_LRS]
        yield "adamw sweep edge", lambda: list(self._extend(self.adamw, self.ADAMW_LRS))
        yield "normuon lr sweep", lambda: [self.normuon(lr, 0) for lr in self.NORMUON_LRS]
        yield "normuon sweep edge", lambda: list(self._extend(self.normuon, self.NORMUON_LRS))
        yield "dion3 f=1/4", lambda: [self.dion3(0.25, m, 0) for m in MU_RULES]
        yield "headline seeds", lambda: [
            run for s in (1, 2) for run in (
                self.adamw(self.adam_best(), s), self.normuon(self.normuon_best(), s),
                *(self.dion3(0.25, m, s) for m in MU_RULES))]
        yield "dion3 f=1/2, 1/8", lambda: [self.dion3(f, m, 0) for f in (0.5, 0.125)
                                           for m in MU_RULES]
        yield "equal time", self._equal_time
        yield "f seeds", lambda: [self.dion3(f, m, s) for s in (1, 2) for f in (0.5, 0.125)
                                  for m in MU_RULES]
        yield "lr x f grid", lambda: self._grid((0.5, 2.0))
        yield "weight decay", self._weight_decay
        yield "lr x f grid, wide", lambda: self._grid((0.25, 4.0))
        yield "weight decay seeds", lambda: self._weight_decay(seeds=(1, 2))

    def _equal_time(self):
        t = self.step_ms.get("dion3@0.25")
        if not t:
            return []
        runs = []
        for seed in range(3):
            for make, best in ((self.adamw, self.adam_best()),
                               (self.normuon, self.normuon_best())):
                fam = make(best, 0).family
                steps = min(self.max_steps, round(self.steps * t / self.step_ms[fam]))
                runs.append(make(best, seed, steps=steps, phase="time"))
        return runs

    def _grid(self, mults):
        mu = self.mu_best()
        runs = [self.dion3(f, mu, 0, lr_mult=m, phase="grid") for f in FRACTIONS for m in mults]
        return runs + [self.normuon(self.normuon_best() * m, 0, phase="grid") for m in mults]

    def _weight_decay(self, seeds=(0,)):
        mu, runs = self.mu_best(), []
        for seed in seeds:
            runs.append(self.normuon(self.normuon_best(), seed, phase="wd", wd=self.BIG_WD))
            for f in FRACTIONS:
                runs.append(self.dion3(f, mu, seed, base_wd=self.BIG_WD, phase="wd"))
                runs.append(self.dion3(f, mu, seed, wd_rule="sqrt_f", base_wd=self.BIG_WD,
                                       phase="wd"))
                if not seeds[0]:  # the scaled rule at the default weight decay too
                    runs.append(self.dion3(f, mu, seed, wd_rule="sqrt_f", phase="wd"))
        return runs


# ---------------------------------------------------------------------------------------------
# Training (imports JAX lazily so that --help and --report stay light)
# ---------------------------------------------------------------------------------------------


def _make_tx(family: str, param_dtype: str = "float32", polar: str = "default",
             mu_dtype: str = "float32"):
    """An ``inject_hyperparams`` optimizer for a compiled step (a family, parameter storage,
    Dion3's polar and momentum dtype); the values are set per run in the state.

    For 16-bit parameters it runs on float32 copies (``param_rounding.float32_view``).
    """
    make = _make_base_tx(family, polar, mu_dtype)
    if param_dtype == "float32":
        return make
    return lambda run: param_rounding.float32_view(make(run))


#: --plan floor's polars other than the default, as ``make_orthogonalizer`` options:
#: ``norm_bound``, the default coefficients after the scalar rescaling; ``pe4_bound``, the
#: 4-step ``polar_express_4`` coefficients after the same rescaling, with no restart.
POLARS = {
    "norm_bound": dict(preconditioning="norm_bound"),
    "pe4_bound": dict(coefficients="polar_express_4", restarts=(), preconditioning="norm_bound"),
}


def _dion3_options(polar: str, mu_dtype: str) -> dict:
    """Dion3's static options for a non-default polar (:data:`POLARS`) or momentum dtype; empty
    for the defaults."""
    import jax.numpy as jnp

    import dion3_jax

    options = {}
    if polar != "default":
        options["orthogonalizer"] = dion3_jax.make_orthogonalizer(**POLARS[polar])
    if mu_dtype != "float32":
        options["mu_dtype"] = jnp.dtype(mu_dtype)
    return options


def _make_base_tx(family: str, polar: str = "default", mu_dtype: str = "float32"):
    import optax

    import dion3_jax

    def inject(fn, *static):
        return optax.inject_hyperparams(fn, static_args=static, hyperparam_dtype=_f32())

    if (polar, mu_dtype) != ("default", "float32") and not family.startswith("dion3@"):
        raise ValueError(f"polar {polar!r} and mu_dtype {mu_dtype!r} are Dion3's options; "
                         f"{family} takes only the defaults")
    if family == "adamw":
        mask = lambda p: _tree_map(lambda x: x.ndim >= 2, p)
        return lambda run: inject(optax.adamw, "mask")(
            learning_rate=run.lr, b1=0.9, b2=0.95, weight_decay=run.wd, mask=mask)
    kwargs = lambda run: dict(learning_rate=run.lr, mu=run.mu, beta2=0.95, weight_decay=run.wd,
                              adam_learning_rate=run.adam_lr, adam_b1=0.9, adam_b2=0.95)
    if family == "normuon":
        return lambda run: inject(dion3_jax.normuon)(**kwargs(run))
    fraction, options = float(family.split("@")[1]), _dion3_options(polar, mu_dtype)
    return lambda run: inject(dion3_jax.dion3, "fraction", *options)(
        fraction=fraction, **kwargs(run), **options)


def _f32():
    import jax.numpy as jnp

    return jnp.float32


def _tree_map(fn, tree):
    import jax

    return jax.tree.map(fn, tree)


def _schedule_mult(step, warmup, total):
    """Linear warm-up over ``warmup`` steps, then cosine decay to 0 at ``total`` (traced)."""
    import jax.numpy as jnp

    step = step.astype(jnp.float32)
    warm = step / jnp.maximum(warmup, 1.0)
    frac = jnp.clip((step - warmup) / jnp.maximum(total - warmup, 1.0), 0.0, 1.0)
    return jnp.where(step < warmup, warm, 0.5 * (1.0 + jnp.cos(jnp.pi * frac)))


class Trainer:
    """Holds the data on the device and one compiled step per optimizer family."""

    def __init__(self, args: argparse.Namespace):
        import jax
        from flax import nnx

        import train_lm

        self.args = args
        cfg = train_lm.Config(d_model=args.d_model, layers=args.layers, heads=args.heads,
                              seq_len=args.seq_len, compute_dtype=args.compute_dtype)
        self.model_cfg = cfg
        train, held, self.data_info = train_lm.load_stdlib_bytes(args.data_mb,
                                                                 args.heldout_percent)
        self.max_steps = train.size // (args.batch * args.seq_len)  # one epoch
        n = args.eval_batches * args.batch
        starts = train_lm.fixed_eval_starts(held.size, n, args.seq_len)
        held_w = train_lm.windows(held, starts, args.seq_len)
        self.train_dev = jax.device_put(train)
        self.held_dev = jax.device_put(held_w.reshape(args.eval_batches, args.batch, -1))
        model = train_lm.ByteLM(cfg, nnx.Rngs(0))
        self.graphdef, params = nnx.split(model, nnx.Param)
        self.n_params = int(sum(x.size for x in jax.tree.leaves(params)))
        self.train_size = train.size
        self.compiled: dict[str, object] = {}
        self.compile_s: dict[str, float] = {}

    # -- pure functions ------------------------------------------------------------------------

    def params(self, seed: int, param_dtype: str = "float32"):
        """The model's initial parameters for ``seed``, stored in ``param_dtype`` (a 16-bit
        model starts from the rounding of the float32 initialization)."""
        from flax import nnx

        import train_lm

        params = nnx.split(train_lm.ByteLM(self.model_cfg, nnx.Rngs(seed)), nnx.Param)[1]
        return param_rounding.cast_params(params, param_dtype)

    def _loss(self, params, batch):
        import optax
        from flax import nnx

        logits = nnx.merge(self.graphdef, params)(batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    def _batch(self, data, starts, step):
        import jax.numpy as jnp

        idx = starts[step][:, None] + jnp.arange(self.args.seq_len + 1)
        return data[idx].astype(jnp.int32)

    def _step_fn(self, tx, rounding: str = "once"):
        import jax

        def step(params, opt_state, data, starts, hp):
            i = opt_state.count
            loss, grads = jax.value_and_grad(self._loss)(params, self._batch(data, starts, i))
            mult = _schedule_mult(i, hp["warmup"], hp["total"])
            hps = dict(opt_state.hyperparams)
            hps["learning_rate"] = hp["lr"] * mult
            if "adam_learning_rate" in hps:
                hps["adam_learning_rate"] = hp["adam_lr"] * mult
            updates, opt_state = tx.update(grads, opt_state._replace(hyperparams=hps), params)
            return param_rounding.apply_updates(params, updates, rounding), opt_state, loss

        return step

    def _eval_fn(self, params, windows):
        import jax

        return jax.lax.map(lambda b: self._loss(params, b), windows).mean()

    def _grad_fn(self, params, data, starts, i):
        import jax

        return jax.grad(self._loss)(params, self._batch(data, starts, i))

    # -- compilation ---------------------------------------------------------------------------

    def _hp(self, run: Run):
        import jax

        warmup = max(1, round(0.1 * run.steps))
        return jax.device_put({k: np.float32(v) for k, v in dict(
            lr=run.lr, adam_lr=run.adam_lr, warmup=warmup, total=run.steps).items()})

    def _starts(self, seed: int):
        """One random window start per (step, row), for up to one epoch of steps."""
        import jax

        rng = np.random.default_rng(seed)
        high = self.train_size - self.args.seq_len - 1
        return jax.device_put(rng.integers(0, high, size=(self.max_steps, self.args.batch),
                                           dtype=np.int32))

    def compile_all(self, examples: dict[str, Run]) -> None:
        """Lowers the step of every ``examples`` entry (by step name), an evaluation per
        parameter dtype and the grad-only step, and compiles them in threads."""
        import jax

        starts, lowered = self._starts(0), {}
        for name, run in examples.items():
            make = _make_tx(run.family, run.param_dtype, run.polar, run.mu_dtype)
            params = self.params(0, run.param_dtype)
            tx = make(run)
            step = jax.jit(self._step_fn(tx, run.rounding), donate_argnums=(0, 1))
            lowered[name] = (make, step.lower(params, tx.init(params), self.train_dev, starts,
                                              self._hp(run)))
        for dtype in sorted({run.param_dtype for run in examples.values()}):
            lowered[_eval_name(dtype)] = (None, jax.jit(self._eval_fn).lower(
                self.params(0, dtype), self.held_dev))
        params = self.params(0)
        lowered["grad"] = (None, jax.jit(self._grad_fn).lower(params, self.train_dev, starts, 0))

        def compile_one(name):
            t0 = time.perf_counter()
            exe = lowered[name][1].compile()
            return name, exe, time.perf_counter() - t0

        workers = min(self.args.compile_workers, len(lowered))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            for name, exe, secs in pool.map(compile_one, lowered):
                self.compiled[name] = (lowered[name][0], exe)
                self.compile_s[name] = secs

    # -- running -------------------------------------------------------------------------------

    def grad_ms(self, reps: int = 20) -> float:
        """Milliseconds of one forward + backward pass (no optimizer), median of ``reps``."""
        exe = self.compiled["grad"][1]
        params, starts = self.params(0), self._starts(0)
        return _median_ms(lambda i: exe(params, self.train_dev, starts, i), reps, warmup=1)

    def step_ms(self, run: Run, reps: int = 30) -> float:
        """Milliseconds of one training step of ``run``'s compiled step (median of ``reps``
        synced steps)."""
        make, exe = self.compiled[run.step_name]
        params = self.params(0, run.param_dtype)
        box = [params, make(run).init(params)]
        starts, hp = self._starts(0), self._hp(run)

        def one(_):
            box[0], box[1], loss = exe(box[0], box[1], self.train_dev, starts, hp)
            return loss

        return _median_ms(one, reps, warmup=3)

    def evaluate(self, params, param_dtype: str = "float32") -> float:
        return float(self.compiled[_eval_name(param_dtype)][1](params, self.held_dev))

    def train(self, run: Run) -> dict:
        """Trains one run; returns its record (curves, final held-out loss, step time)."""
        import jax

        make, exe = self.compiled[run.step_name]
        params = self.params(run.seed, run.param_dtype)
        state = make(run).init(params)
        starts, hp = self._starts(run.seed), self._hp(run)
        ev = sorted(set(range(self.args.eval_every, run.steps, self.args.eval_every))
                    | {run.steps})
        curve, losses, train_s, done = [], [], 0.0, 0
        for stop in ev:
            t0 = time.perf_counter()
            for _ in range(stop - done):
                params, state, loss = exe(params, state, self.train_dev, starts, hp)
                losses.append(loss)
            jax.block_until_ready(loss)
            train_s += time.perf_counter() - t0
            done = stop
            curve.append((stop, self.evaluate(params, run.param_dtype), round(train_s, 4)))
        train_losses = [float(x) for x in jax.device_get(losses)]
        return dict(
            **run.record(), family=run.family, config=None,
            final_heldout=curve[-1][1], heldout_curve=curve,
            train_curve=_block_means(train_losses, 10), step_ms=1e3 * train_s / run.steps,
            train_s=train_s,
        )


def _eval_name(param_dtype: str) -> str:
    """The compiled evaluation of parameters stored in ``param_dtype``."""
    return "eval" if param_dtype == "float32" else f"eval {param_dtype}"


def _median_ms(call, reps: int, warmup: int) -> float:
    """Median milliseconds of ``call(i)`` for ``i < reps``, each waited for, after ``warmup``
    untimed calls (``call(0)``, ``call(1)``, …)."""
    import jax

    for i in range(warmup):
        jax.block_until_ready(call(i))
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(call(i))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def _block_means(xs: list[float], k: int) -> list[float]:
    """Means of consecutive blocks of ``k`` values (a compact training curve)."""
    return [sum(xs[i:i + k]) / len(xs[i:i + k]) for i in range(0, len(xs), k)]


def load_runs(path: str, planner: Planner | None = None) -> int:
    """Reads the finished runs of a results file, recording them in ``planner``; their count."""
    names = {f.name for f in dataclasses.fields(Run)}
    count = 0
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("type") == "run":
                count += 1
                if planner is not None:
                    planner.record(Run(**{k: v for k, v in rec.items() if k in names}), rec)
    return count


def _where(path: str) -> str:
    """``path`` relative to the working directory when it lies inside it, else as it is."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def _meta(args, trainer) -> dict:
    """The results file's first record: the command, versions, model, data and plan. It names
    no machine and no absolute path (the data root is named by the Python version)."""
    import jax

    import dion3_jax

    dev = jax.devices()[0]
    stdlib = f"python{sys.version_info.major}.{sys.version_info.minor} stdlib"
    return dict(
        type="meta", argv=sys.argv[1:], tag=args.tag, plan=args.plan,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        device=f"{dev.platform}: {dev.device_kind}", n_devices=jax.device_count(),
        python=platform.python_version(), jax=jax.__version__,
        dion3_jax=_where(os.path.dirname(dion3_jax.__file__)),
        params=trainer.n_params, data=dict(trainer.data_info, root=stdlib),
        max_steps=trainer.max_steps,
        model=dict(d_model=args.d_model, layers=args.layers, heads=args.heads,
                   seq_len=args.seq_len, batch=args.batch, compute_dtype=args.compute_dtype,
                   param_dtype=args.param_dtype, rounding=args.rounding),
        steps=args.steps, eval_every=args.eval_every, eval_batches=args.eval_batches,
    )


def study(args: argparse.Namespace) -> str:
    """Runs the whole study, appending JSON lines to ``args.out``; returns its path."""
    start = time.perf_counter()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    if os.path.exists(args.out):
        raise SystemExit(f"{args.out} exists; pass a new --out (results are never overwritten)")
    trainer = Trainer(args)
    planner = Planner(args.steps, trainer.max_steps, args.param_dtype, args.rounding,
                      args.seeds)
    for path in args.resume or []:
        print(f"resumed {load_runs(path, planner)} runs from {path}", flush=True)
    if args.steps > trainer.max_steps:
        raise SystemExit(f"--steps {args.steps} is more than one epoch ({trainer.max_steps})")
    with open(args.out, "w") as out:
        def emit(rec):
            out.write(json.dumps(rec) + "\n")
            out.flush()

        emit(_meta(args, trainer))
        print(f"model {trainer.n_params / 1e6:.1f}M params; data {trainer.data_info}", flush=True)
        examples = planner.examples(args.plan)
        trainer.compile_all(examples)
        grad_ms = trainer.grad_ms()
        step_ms = {name: trainer.step_ms(run) for name, run in examples.items()}
        family_ms = {}  # equal-time runs: step times measured before any run
        for name, run in examples.items():
            family_ms.setdefault(run.family, step_ms[name])
        planner.step_ms.update(family_ms)
        emit(dict(type="timing", compile_s=trainer.compile_s, grad_ms=grad_ms, step_ms=step_ms,
                  elapsed_s=time.perf_counter() - start))
        print(f"compiled in {time.perf_counter() - start:.0f} s: {trainer.compile_s}; "
              f"forward+backward {grad_ms:.2f} ms", flush=True)
        _run_phases(args, trainer, planner, emit, start)
    return args.out


def _run_phases(args, trainer, planner, emit, start) -> None:
    for phase, plan in planner.phases(args.plan):
        for run in plan():
            if run.key() in planner.results:
                continue
            guess = planner.last_ms.get(run.step_name, 50.0) * run.steps / 1e3 + 1.0
            left = args.time_budget - (time.perf_counter() - start)
            if guess > left:
                emit(dict(type="skip", phase=phase, run=run.record(), left_s=left))
                print(f"[{phase}] skip {run} ({left:.0f} s left)", flush=True)
                continue
            rec = trainer.train(run)
            rec["config"] = config_name(rec)
            rec["elapsed_s"] = round(time.perf_counter() - start, 1)
            planner.record(run, rec)
            emit(dict(type="run", **rec))
            print(f"[{phase}] {rec['config']} seed {run.seed}: held-out "
                  f"{rec['final_heldout']:.4f}, {rec['step_ms']:.1f} ms/step "
                  f"(t={rec['elapsed_s']:.0f} s)", flush=True)


def report(args: argparse.Namespace) -> str:
    """Writes ``args.doc`` from the ``--report`` files (``examples/quality_report.py``)."""
    import quality_report

    return quality_report.report(args.report, args.doc, args.plots, args.command, args.notes)


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    if args.report:
        return report(args)
    if importlib.util.find_spec("dion3_jax") is None:  # a checkout without `pip install -e .`
        sys.path.insert(0, os.path.dirname(_HERE))
    return study(args)


if __name__ == "__main__":
    main()
