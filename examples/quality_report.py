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
"""``docs/QUALITY.md`` and its plots from the JSON lines of ``examples/quality_study.py``.

Needs numpy and matplotlib, no accelerator; every number in the document comes from the results
files. Results of ``--plan rounding`` among them become the section "bf16 parameters: rounding"
(``examples/rounding_report.py``), those of ``--plan floor`` the section "Past the floor: polar
rescaling and 16-bit momentum" (``examples/floor_report.py``). ``quality_study.py --report`` runs
the same report::

    python examples/quality_report.py RESULTS.jsonl [MORE.jsonl ...] [--notes NOTES.md]
        [--doc docs/QUALITY.md] [--plots docs/quality] [--command "..."]
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import shlex
import statistics

import numpy as np

DEFAULT_DOC = "docs/QUALITY.md"
DEFAULT_PLOTS = "docs/quality"
#: A line of the notes file that splits it: the part before goes first, the rest last.
NOTES_MARK = "<!-- end of summary -->"

HEADLINE_NOTE = (
    "Held-out loss is the mean next-byte cross-entropy (nats/byte) on 16 × 32 fixed windows "
    "of 513 bytes spread over the held-out files, after the last step; ± is the standard "
    "deviation over seeds (the seed sets the initialization and the batch order).")


# ---------------------------------------------------------------------------------------------
# Loading and grouping
# ---------------------------------------------------------------------------------------------


def load(paths: list[str]) -> dict:
    """Reads results files: ``meta`` (the first), ``timing``, ``runs`` and ``skips``."""
    import json

    out = dict(meta=[], timing=[], runs=[], skips=[])
    for path in paths:
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                key = {"meta": "meta", "timing": "timing", "run": "runs"}.get(rec["type"], "skips")
                out[key].append(rec)
    if not out["meta"]:
        raise ValueError(f"no meta record in {paths}")
    return out


def group(runs: list[dict]) -> dict[str, list[dict]]:
    """Runs by configuration (everything but the seed), in first-run order."""
    groups = collections.OrderedDict()
    for r in runs:
        groups.setdefault(r["config"], []).append(r)
    return groups


def stats(runs: list[dict]) -> tuple[float, float, int]:
    """Mean and standard deviation (0 for one run) of the final held-out loss, and the count."""
    xs = [r["final_heldout"] for r in runs]
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0), len(xs)


def fmt(runs: list[dict]) -> str:
    mean, std, n = stats(runs)
    return f"{mean:.4f} ± {std:.4f} (n={n})" if n > 1 else f"{mean:.4f} (n=1)"


def best(groups: dict, opt: str, phase_ok=("adamw", "normuon")) -> str | None:
    """The configuration of ``opt`` with the lowest seed-0 held-out loss at equal steps."""
    cands = [(g[0]["final_heldout"], name) for name, g in groups.items()
             if g[0]["opt"] == opt and g[0]["phase"] in phase_ok
             and any(r["seed"] == 0 for r in g)]
    return min(cands)[1] if cands else None


def median_step_ms(runs: list[dict], family: str) -> float | None:
    xs = [r["step_ms"] for r in runs if r["family"] == family]
    return float(np.median(xs)) if xs else None


def loss_at_time(run: dict, seconds: float) -> float | None:
    """Held-out loss read off a run's curve at ``seconds`` of training (linear interpolation)."""
    pts = [(0.0, None)] + [(t, x) for _, x, t in run["heldout_curve"]]
    for (t0, x0), (t1, x1) in zip(pts, pts[1:]):
        if t0 <= seconds <= t1:
            return x1 if x0 is None else x0 + (x1 - x0) * (seconds - t0) / (t1 - t0)
    return None


def dion3_groups(groups: dict, fraction: float, phases=("dion3",), wd=None) -> dict[str, list]:
    """Dion3 configurations at ``fraction`` (lr multiplier 1), by μ rule."""
    out = {}
    for name, g in groups.items():
        r = g[0]
        if (r["opt"] == "dion3" and r["fraction"] == fraction and r["phase"] in phases
                and r["lr_mult"] == 1.0 and (wd is None or math.isclose(r["wd"], wd))):
            out[r["mu_rule"]] = g
    return out


# ---------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plain_ticks(ax) -> None:
    """Log-scale x axis with plain decimal tick labels (0.02, not 2^-5.6)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def plot_curves(groups: dict, names: list[str], path: str) -> None:
    """Held-out loss against steps and against training seconds; mean over seeds per config."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for i, name in enumerate(names):
        g = groups[name]
        steps = [s for s, _, _ in g[0]["heldout_curve"]]
        loss = np.mean([[x for _, x, _ in r["heldout_curve"]] for r in g], axis=0)
        secs = np.mean([[t for _, _, t in r["heldout_curve"]] for r in g], axis=0)
        label = f"{name} (n={len(g)})"
        axes[0].plot(steps, loss, "o-", color=f"C{i}", ms=3, label=label)
        axes[1].plot(secs, loss, "o-", color=f"C{i}", ms=3, label=label)
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("training seconds (measured, evaluation excluded)")
    axes[0].set_ylabel("held-out loss (nats/byte)")
    lo = min(r["final_heldout"] for n in names for r in groups[n])
    for ax in axes:
        ax.set_ylim(lo - 0.05, lo + 1.2)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_lr(groups: dict, path: str) -> None:
    """Seed-0 held-out loss against lr·√f (matrix optimizers) and lr (AdamW)."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    series = collections.defaultdict(list)
    for g in groups.values():
        r = next((r for r in g if r["seed"] == 0), None)
        if r is None or r["phase"] in ("time", "wd"):
            continue
        if r["opt"] == "adamw":
            series["AdamW"].append((r["lr"], r["final_heldout"]))
        else:
            key = ("NorMuon (f=1)" if r["opt"] == "normuon"
                   else f"Dion3 f=1/{round(1 / r['fraction'])}, μ {r['mu']:.3g}")
            series[key].append((r["lr"] * math.sqrt(r["fraction"]), r["final_heldout"]))
    for i, (key, pts) in enumerate(sorted(series.items())):
        pts.sort()
        ax = axes[0] if key == "AdamW" else axes[1]
        ax.plot(*zip(*pts), "o-", color=f"C{i}", label=key)
    axes[0].set_xlabel("AdamW learning rate")
    axes[1].set_xlabel("lr · √f  (the transfer rule keeps this fixed)")
    axes[0].set_ylabel("held-out loss, seed 0 (nats/byte)")
    for ax in axes:
        _plain_ticks(ax)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_heatmap(grid: dict[tuple[float, float], float], path: str) -> None:
    """Held-out loss over (lr multiplier of the transferred lr) × f."""
    plt = _plt()
    fs = sorted({f for f, _ in grid}, reverse=True)
    ms = sorted({m for _, m in grid})
    z = np.full((len(fs), len(ms)), np.nan)
    for (f, m), x in grid.items():
        z[fs.index(f), ms.index(m)] = x
    fig, ax = plt.subplots(figsize=(6, 3.8))
    im = ax.imshow(z, cmap="viridis_r", aspect="auto")
    for i in range(len(fs)):
        for j in range(len(ms)):
            if np.isfinite(z[i, j]):
                ax.text(j, i, f"{z[i, j]:.3f}", ha="center", va="center", color="w", fontsize=8)
    ax.set_xticks(range(len(ms)), [f"{m:g}×" for m in ms])
    ax.set_yticks(range(len(fs)), [f"1/{round(1 / f)}" if f < 1 else "1" for f in fs])
    ax.set_xlabel("lr / (lr_NorMuon / √f)")
    ax.set_ylabel("f")
    fig.colorbar(im, label="held-out loss, seed 0")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# The document
# ---------------------------------------------------------------------------------------------


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _seeds(g: list[dict]) -> str:
    return ", ".join(f"{r['final_heldout']:.4f}" for r in sorted(g, key=lambda r: r["seed"]))


def section_setup(data: dict, command: str) -> str:
    m, runs = data["meta"][0], data["runs"]
    mdl, d = m["model"], m["data"]
    per_step = mdl["batch"] * mdl["seq_len"]
    timing = data["timing"][0] if data["timing"] else {}
    planned = len(runs) + sum(1 for s in data["skips"] if s["type"] == "skip")
    return "\n".join([
        "## How it was run", "",
        "```bash", command, "```", "",
        _table(["", ""], [
            ["code", m.get("tag") or "(not recorded)"],
            ["date", m["date"]],
            ["machine", f"{m['device']} ({m['n_devices']} device), Python {m['python']}, "
                        f"jax {m['jax']}"],
            ["model", f"{m['params'] / 1e6:.1f}M parameters: the main job's byte-level "
                      f"transformer (`examples/train_lm.py`), d_model {mdl['d_model']}, "
                      f"{mdl['layers']} blocks, {mdl['heads']} heads, rotary embeddings, GELU MLP "
                      f"×4, RMSNorm, untied `embed` / `lm_head`; {mdl['compute_dtype']} "
                      f"activations, float32 parameters"],
            ["data", f"`{d['root']}`: {d['train_files']} training files "
                     f"({d['train_bytes'] / 1e6:.2f} MB) and {d['heldout_files']} held-out files "
                     f"({d['heldout_bytes'] / 1e6:.2f} MB), split by a hash of the path"],
            ["budget", f"{m['steps']} steps of {mdl['batch']} × {mdl['seq_len']} bytes "
                       f"({m['steps'] * per_step / 1e6:.1f} MB, "
                       f"{m['steps'] * per_step / d['train_bytes']:.2f} epoch), linear warm-up "
                       f"over 10% of the steps, cosine decay to 0"],
            ["AdamW", "`optax.adamw`, b1 0.9, b2 0.95, weight decay 0.1 on 2-D leaves"],
            ["NorMuon", "`dion3_jax.normuon`, μ 0.95, β2 0.95, weight decay 0.01; its AdamW "
                        "branch (`embed`, `lm_head`, norms) at the best AdamW lr, b1 0.9, b2 0.95"],
            ["Dion3", "`dion3_jax.dion3`, the same settings plus the fraction f; lr = NorMuon's "
                      "best lr / √f (`dion3_jax.transfer_learning_rate`); μ = 0.95 or 0.95^(1/f)"],
            ["runs", f"{len(runs)} finished of the {planned} planned, in priority order, before "
                     f"the time budget ran out; compilation "
                     f"{max(timing.get('compile_s', {0: 0}).values()):.0f} s (in parallel)"],
        ]),
    ])


def section_headline(groups: dict) -> tuple[str, list[str]]:
    names = [n for n in (best(groups, "adamw"), best(groups, "normuon")) if n]
    for f in (0.25, 0.5, 0.125):
        names += [g[0]["config"] for g in dion3_groups(groups, f).values()]
    rows = []
    for n in names:
        g = groups[n]
        rows.append([n, fmt(g), _seeds(g), f"{np.median([r['step_ms'] for r in g]):.0f}"])
    text = "\n".join([
        "## Held-out loss at equal steps", "",
        "AdamW and NorMuon at the best learning rate of their sweeps (seed 0), Dion3 at the "
        "transferred learning rate. " + HEADLINE_NOTE, "",
        _table(["configuration", "held-out mean ± std", "per seed (0, 1, 2)", "step ms"], rows),
        "", "![held-out loss curves](quality/curves.png)", "",
        "Held-out loss against steps (left) and against measured training seconds (right), mean "
        "over the seeds that finished.",
    ])
    return text, names


def section_sweeps(groups: dict) -> str:
    rows = []
    for opt in ("adamw", "normuon"):
        for n, g in groups.items():
            r0 = next((r for r in g if r["seed"] == 0), None)
            if r0 and g[0]["opt"] == opt and g[0]["phase"] == opt:
                rows.append([opt.replace("adamw", "AdamW").replace("normuon", "NorMuon"),
                             f"{r0['lr']:g}", f"{r0['final_heldout']:.4f}"])
    return "\n".join([
        "## Learning-rate sweeps (seed 0)", "",
        _table(["optimizer", "peak lr", "held-out"], rows), "",
        "![held-out loss against learning rate](quality/lr.png)", "",
        "Right: the matrix optimizers against lr·√f; a Dion3 point at the same lr·√f as "
        "NorMuon's best is the transfer rule's prediction.",
    ])


def section_mu(groups: dict) -> str:
    rows = []
    for f in (0.5, 0.25, 0.125):
        by_rule = dion3_groups(groups, f)
        if not by_rule:
            continue
        const, pow_ = by_rule.get("const"), by_rule.get("pow")
        cell = lambda g: fmt(g) if g else "not run"
        diff = (f"{stats(pow_)[0] - stats(const)[0]:+.4f}" if const and pow_ else "")
        rows.append([f"1/{round(1 / f)}", f"{0.95 ** (1 / f):.4f}", cell(const), cell(pow_),
                     diff])
    return "\n".join([
        "## The momentum rule: μ = 0.95 or μ = 0.95^(1/f)", "",
        "With error feedback a row's momentum decays only on the steps where the row is "
        "selected, about once every 1/f steps, so μ = 0.95 remembers about 1/(1 − 0.95^f) steps "
        "(78 at f = 1/4) instead of NorMuon's 20; μ = 0.95^(1/f) keeps NorMuon's horizon.", "",
        _table(["f", "0.95^(1/f)", "μ = 0.95", "μ = 0.95^(1/f)", "difference"], rows),
    ])


def _segment_ms(r: dict, first: bool) -> float:
    """ms per step over a run's first (or last) evaluation interval."""
    (s0, _, t0), (s1, _, t1) = (r["heldout_curve"][0], r["heldout_curve"][0]) if first else \
        r["heldout_curve"][-2:]
    return 1e3 * (t0 / s0 if first else (t1 - t0) / (s1 - s0))


def section_time(data: dict, groups: dict, names: list[str]) -> str:
    runs, timing = data["runs"], (data["timing"][0] if data["timing"] else {})
    grad = timing.get("grad_ms")
    rows = []
    for fam in ("adamw", "normuon", "dion3@0.5", "dion3@0.25", "dion3@0.125"):
        fam_runs = [r for r in runs if r["family"] == fam and len(r["heldout_curve"]) > 1]
        if not fam_runs:
            continue
        xs = [r["step_ms"] for r in fam_runs]
        first = np.median([_segment_ms(r, True) for r in fam_runs])
        last = np.median([_segment_ms(r, False) for r in fam_runs])
        rows.append([fam, f"{np.median(xs):.1f}", f"{min(xs):.1f} – {max(xs):.1f}",
                     f"{first:.0f}", f"{last:.0f}", str(len(xs))])
    # Equal time: the shortest median run time among the headline configurations.
    t_eq = min((np.median([r["train_s"] for r in groups[n]]) for n in names), default=0.0)
    eq_rows = []
    for n in names:
        vals = [loss_at_time(r, t_eq) or r["final_heldout"] for r in groups[n]]
        eq_rows.append([n, f"{statistics.fmean(vals):.4f}", str(len(vals))])
    timed = [n for n, g in groups.items() if g[0]["phase"] == "time"]
    lines = [
        "## Step time and equal optimizer time", "",
        "Milliseconds per training step (one jitted step: batch gather, forward, backward, "
        "optimizer update), measured over each run with evaluations excluded; the median and "
        "range over runs, and the medians over the first and the last 50 steps."
        + (f" A jitted forward + backward alone (no optimizer) took {grad:.1f} ms at the "
           f"initial parameters." if grad else ""), "",
        _table(["step", "median ms", "range", "steps 1–50", "last 50 steps", "runs"], rows), "",
        f"Held-out loss at equal training time, **{t_eq:.1f} s** (the shortest median run time "
        f"among the headline configurations), read off each run's curve by linear interpolation "
        f"between evaluations every 50 steps (a run that ended sooner counts with its final "
        f"loss). Each run keeps its own {data['meta'][0]['steps']}-step schedule, so a slower "
        f"run is read before its learning rate has decayed: this favors the faster optimizer.",
        "",
        _table(["configuration", f"held-out at {t_eq:.1f} s", "runs"], eq_rows),
    ]
    if timed:
        lines += ["", "Runs given an equal time budget through their step count (a full "
                  "schedule each):", "",
                  _table(["configuration", "held-out", "per seed"],
                         [[n, fmt(groups[n]), _seeds(groups[n])] for n in timed])]
    return "\n".join(lines)


def grid_cells(groups: dict) -> dict[tuple[float, float], float]:
    """(f, lr multiplier of the transferred lr) → seed-0 held-out loss at weight decay 0.01.

    Dion3 cells take the better μ rule; NorMuon's sweep is the row f = 1, its multipliers
    relative to its best lr.
    """
    grid, normuon = {}, {}
    for g in groups.values():
        r = next((r for r in g if r["seed"] == 0), None)
        if not r or r["wd_rule"] != "const" or not math.isclose(r["wd"], 0.01) or \
                r["phase"] == "time":
            continue
        if r["opt"] == "dion3" and r["phase"] in ("dion3", "grid"):
            grid.setdefault((r["fraction"], r["lr_mult"]), []).append(r["final_heldout"])
        elif r["opt"] == "normuon":
            normuon[r["lr"]] = r["final_heldout"]
    cells = {k: min(v) for k, v in grid.items()}
    if normuon:
        best = min(normuon, key=normuon.get)
        cells.update({(1.0, round(lr / best, 6)): x for lr, x in normuon.items()})
    return cells


def section_grid(groups: dict, plots: str) -> str:
    cells = grid_cells(groups)
    fs = sorted({f for f, _ in cells}, reverse=True)
    ms = sorted({m for _, m in cells})
    head = "## Learning rate × f: does lr·√f transfer?"
    if len({m for f, m in cells if f < 1}) < 2:
        return "\n".join([head, "", "**Not run**: the time budget ended before the grid phase "
                          "(learning-rate multipliers 1/4, 1/2, 2, 4 of the transferred rate at "
                          "f = 1/2, 1/4, 1/8). The only evidence here is the lr plot above: one "
                          "Dion3 point per f at the transferred rate."])
    plot_heatmap(cells, os.path.join(plots, "heatmap.png"))
    name = lambda f: "1 (NorMuon)" if f == 1 else f"1/{round(1 / f)}"
    rows = [[name(f)] + [f"{cells[(f, m)]:.4f}" if (f, m) in cells else "–" for m in ms]
            + [f"{min((m for g, m in cells if g == f), key=lambda m: cells[(f, m)]):g}×"]
            for f in fs]
    return "\n".join([
        head, "",
        "Held-out loss of seed 0 at learning rate = multiplier × NorMuon's best lr / √f "
        "(weight decay 0.01; Dion3 with the better μ rule, which was 0.95^(1/f) in every "
        "cell run with both). If lr·√f transfers, every row is best at 1×.", "",
        _table(["f"] + [f"{m:g}×" for m in ms] + ["best"], rows), "",
        "![lr × f heat map](quality/heatmap.png)"])


def section_wd(groups: dict) -> str:
    rows = []
    for g in groups.values():
        r = g[0]
        if r["phase"] == "wd" or (r["wd_rule"] == "sqrt_f"):
            rows.append([r["config"], r["wd_rule"], fmt(g)])
    head = "## Weight decay: constant or scaled with √f"
    if not rows:
        return "\n".join([head, "", "**Not run**: the time budget ended before this phase "
                          "(weight decay 0.1 constant against 0.1·√f, which keeps the per-step "
                          "decay lr·wd the same for every f under the lr ∝ 1/√f rule)."])
    return "\n".join([head, "", _table(["configuration", "rule", "held-out"], rows)])


def section_not_run(data: dict) -> str:
    by_phase = collections.Counter(s["phase"] for s in data["skips"] if s["type"] == "skip")
    if not by_phase:
        return ""
    rows = [[p, str(n)] for p, n in by_phase.items()]
    return "\n".join(["## Planned but not run (time budget)", "",
                      _table(["phase", "runs skipped"], rows)])


def write_report(paths: list[str] | str, doc: str, plots: str, command: str | None,
                 preamble: str = "", conclusions: str = "", notes_path: str | None = None) -> str:
    """Writes ``doc`` and the PNGs under ``plots`` from results files; returns ``doc``.

    Args:
      paths: results files of ``quality_study.py`` (the first one's meta record is used).
      doc: the Markdown file to write.
      plots: folder of the PNGs (the Markdown links them as ``quality/NAME.png``).
      command: the command to quote; default rebuilt from the first meta record.
      preamble: Markdown put after the title (e.g. the conclusions in words).
      conclusions: Markdown put at the end (e.g. what this scale can and cannot say).
      notes_path: where preamble and conclusions came from, to quote in the document.
    """
    paths = [paths] if isinstance(paths, str) else list(paths)
    data = load(paths)
    os.makedirs(plots, exist_ok=True)
    groups = group(data["runs"])
    meta = data["meta"][0]
    if command is None:
        command = shlex.join(["python3", "examples/quality_study.py", *meta["argv"]])
    headline, names = section_headline(groups)
    plot_curves(groups, names, os.path.join(plots, "curves.png"))
    plot_lr(groups, os.path.join(plots, "lr.png"))
    parts = [
        f"# Quality study: Dion3, NorMuon and AdamW on a {meta['params'] / 1e6:.0f}M-parameter "
        f"byte LM", "",
        "Generated by `python examples/quality_study.py --report " + " ".join(paths) +
        (f" --notes {notes_path}" if notes_path else "") + "` from the study's results (JSON "
        "lines, one per run, committed under `docs/quality/`); the summary and the limits are "
        "written by hand in the notes file.", "",
        preamble, headline, section_sweeps(groups), section_mu(groups),
        section_time(data, groups, names), section_grid(groups, plots), section_wd(groups),
        section_not_run(data), section_setup(data, command), conclusions,
    ]
    with open(doc, "w") as f:
        f.write("\n\n".join(p.strip() for p in parts if p.strip()) + "\n")
    return doc


def report(paths: list[str], doc: str = DEFAULT_DOC, plots: str = DEFAULT_PLOTS,
           command: str | None = None, notes: str | None = None) -> str:
    """Writes ``doc`` from results files: the study's, then the sections of the ``--plan
    rounding`` and ``--plan floor`` files among them (before the notes' closing part); returns
    ``doc``.

    Raises:
      SystemExit: when no file holds results of ``--plan study``.
    """
    import floor_report
    import rounding_report

    rounding = [p for p in paths if rounding_report.is_rounding_results(p)]
    floor = [p for p in paths if p not in rounding and floor_report.is_floor_results(p)]
    studies = [p for p in paths if p not in rounding and p not in floor]
    if not studies:
        raise SystemExit("no results of --plan study among " + " ".join(paths))
    text = ""
    if notes:
        with open(notes) as f:
            text = f.read()
    head, _, tail = text.partition(NOTES_MARK)
    if floor:
        tail = floor_report.section(floor) + "\n\n" + tail.lstrip()
    if rounding:
        tail = rounding_report.section(rounding) + "\n\n" + tail.lstrip()
    return write_report(studies, doc, plots, command, preamble=head, conclusions=tail,
                        notes_path=notes)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def add_report_flags(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """``--notes``, ``--doc``, ``--plots`` and ``--command`` (help text led by ``prefix``)."""
    p.add_argument("--notes", default=None,
                   help=f"{prefix}Markdown in words to include; the part before a line "
                        f"{NOTES_MARK!r} goes first, the rest last")
    p.add_argument("--doc", default=DEFAULT_DOC, help=f"{prefix}the Markdown file to write")
    p.add_argument("--plots", default=DEFAULT_PLOTS, help=f"{prefix}the folder of the PNGs")
    p.add_argument("--command", default=None,
                   help=f"{prefix}the training command to quote, rebuilt from the results "
                        "when not given")


def build_parser() -> argparse.ArgumentParser:
    """The report's flags: the results files, then where the notes, document and plots are."""
    import _common

    p = _common.make_parser(__doc__)
    p.add_argument("results", metavar="JSONL", nargs="+",
                   help="results files of quality_study.py (--plan study, rounding and floor)")
    add_report_flags(p)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parses the flags; a missing file exits through argparse before anything is read."""
    p = build_parser()
    args = p.parse_args(argv)
    for flag, paths in (("JSONL", args.results), ("--notes", [args.notes] if args.notes else [])):
        for path in paths:
            if not os.path.isfile(path):
                p.error(f"{flag}: no such file {path!r}")
    return args


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    return report(args.results, args.doc, args.plots, args.command, args.notes)


if __name__ == "__main__":
    main()
