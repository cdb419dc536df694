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
"""The 7B-shapes optimizer step of two versions of the library, timed in one process.

One version is the working tree's ``dion3_jax`` / ``pallas_kernels``; the other is an older
commit's, exported with ``git archive`` into a temporary directory and imported as
``dion3_jax_old`` / ``pallas_kernels_old`` (their imports of each other rewritten to the new
names). From each, ``scale_by_dion3(f)`` (the fraction only, every other argument at its
default) followed by ``optax.scale(-1e-3)`` is compiled as ``jit(update + apply_updates)`` with
donated buffers on the benchmarks' model (``_model.py``), and the two steps are timed in
interleaved rounds (``_timing.median_ms_interleaved``), so both see the same device state. On a GPU both
compilations share one autotuning cache (``xla_gpu_per_fusion_autotune_cache_dir``, a fresh
directory per run): a product both versions have gets the cuBLAS algorithm the first
compilation picked, so the comparison does not also compare two draws of XLA's autotuner (which
moved one program's f = 1 step by 1.7% between two compilations). Prints a table: fraction,
old ms, new ms, new / old; with ``--adamw``, ``optax.adamw``'s step joins every set of rounds and
the table gives both versions' ratios to it (the unit of the step targets).

Several older versions can join the same rounds: export each once with its own package suffix
(``--export-to DIR --suffix _b``; a copy of the repository without git history can take the
directories), then pass them all to ``--old-dir``. Each is named by its suffix (``b``), the
table has a column of milliseconds per version and one ratio ``new / name`` per older one, and
every version's step sees the same device state, so the older ones compare with each other too.
Every version keeps its optimizer state and parameters on the device for the whole run: on an
80 GB GPU, four versions and AdamW of the 8-layer step ran out of memory at f = 1/8, where two
versions and AdamW fit.

Usage (repository root; the old commit must be in this checkout's git history)::

    python benchmarks/bench_commits.py                        # b467ab5 against the working tree
    python benchmarks/bench_commits.py --commit HEAD~3 --fractions 0.25
    python benchmarks/bench_commits.py --small --commit HEAD  # tiny model, CPU smoke run
    python benchmarks/bench_commits.py --commit HEAD~3 --fractions 0.25 --adamw --reps 32
    python benchmarks/bench_commits.py --commit HEAD~1 --export-to DIR_A --suffix _a
    python benchmarks/bench_commits.py --commit HEAD~2 --export-to DIR_B --suffix _b
    python benchmarks/bench_commits.py --old-dir DIR_A DIR_B --fractions 0.125
    python benchmarks/bench_commits.py --commit HEAD~1 --fractions 0.25 --mu-dtype bfloat16
    python benchmarks/bench_commits.py --commit HEAD --fractions 1 --polar pe5+bound "pe4+bound r-"
    python benchmarks/bench_commits.py --commit HEAD --fractions 0.25 --momentum bfloat16

Each compile also prints the step's arguments (parameters, state, gradients) and arguments plus
temporaries, in GiB, from XLA's memory analysis of the compiled step. Every version keeps its
parameters and state on the device for the whole run; a version that would not fit beside those
already built stops the run with a ``MemoryError`` that gives both sizes, where XLA's allocator
would wait and retry.
"""

from __future__ import annotations

import argparse
import importlib
import io
import os
import pathlib
import re
import subprocess
import sys
import tarfile
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import _model  # noqa: E402  (the model and its step)
from _timing import median_ms_interleaved  # noqa: E402

PACKAGES = ("dion3_jax", "pallas_kernels")
SUFFIX = "_old"
_FROM = re.compile(r"^(\s*)from\s+(" + "|".join(PACKAGES) + r")\b")
_IMPORT = re.compile(r"^(\s*)import\s+(" + "|".join(PACKAGES) + r")((?:\.\w+)*)(\s+as\s+\w+)?\s*$")
_ANY = re.compile(r"^\s*(import|from)\s[^#]*\b(" + "|".join(PACKAGES) + r")\b")
_SUFFIX_PATTERN = re.compile(r"_[A-Za-z0-9_]+")


def rename_imports(source: str, suffix: str = SUFFIX) -> str:
    """Rewrites a module's imports of ``dion3_jax`` / ``pallas_kernels`` to the names with
    ``suffix`` (``_old`` by default).

    ``from pkg... import x`` becomes ``from pkg_old... import x``; ``import pkg`` becomes
    ``import pkg_old as pkg`` (the rest of the module keeps using the name ``pkg``).

    Raises:
      ValueError: for an import of either package in a form not rewritten here.
    """
    out = []
    for line in source.splitlines(keepends=True):
        text = line.rstrip("\n")
        if m := _FROM.match(text):
            text = f"{m[1]}from {m[2]}{suffix}{text[m.end():]}"
        elif m := _IMPORT.match(text):
            indent, pkg, sub, alias = m[1], m[2], m[3], m[4]
            if sub and not alias:
                raise ValueError(f"cannot rename {text.strip()!r}: write it as 'from' or 'as'")
            text = f"{indent}import {pkg}{suffix}{sub}{alias or f' as {pkg}'}"
        elif _ANY.match(text):
            raise ValueError(f"cannot rename the import {text.strip()!r}")
        out.append(text + line[len(line.rstrip("\n")):])
    return "".join(out)


def export_old(commit: str, dest: pathlib.Path, suffix: str = SUFFIX) -> str:
    """Writes ``commit``'s packages to ``dest`` as ``dion3_jax{suffix}`` /
    ``pallas_kernels{suffix}`` (``_old`` by default).

    Returns:
      The commit's short hash.
    """
    short = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", commit],
                           capture_output=True, text=True, check=True).stdout.strip()
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", commit, *PACKAGES],
                         capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        archive.extractall(dest, filter="data")
    for pkg in PACKAGES:
        (dest / pkg).rename(dest / f"{pkg}{suffix}")
        for path in (dest / f"{pkg}{suffix}").rglob("*.py"):
            path.write_text(rename_imports(path.read_text(), suffix))
    return short


def export_dir(commit: str, dest: pathlib.Path, suffix: str) -> None:
    """``--export-to``: a new directory ``dest`` with ``commit``'s renamed packages, its short
    hash in ``COMMIT`` and the suffix in ``SUFFIX``, for ``--old-dir``."""
    if not _SUFFIX_PATTERN.fullmatch(suffix):
        raise ValueError(f"--suffix {suffix!r}: an underscore, then letters, digits or "
                         "underscores")
    dest.mkdir(parents=True, exist_ok=False)
    (dest / "COMMIT").write_text(export_old(commit, dest, suffix))
    (dest / "SUFFIX").write_text(suffix)


def old_dirs(dirs: list[str]) -> dict[str, tuple[str, str, str]]:
    """The older versions of ``--old-dir``: ``{name: (directory, suffix, commit)}``. One
    directory is named ``old``; several are named by their suffixes, which must differ and
    name neither ``new`` nor ``adamw`` (a directory without a ``SUFFIX`` file holds ``_old``
    packages)."""
    out = {}
    for d in map(os.path.abspath, dirs):
        suffix_file = pathlib.Path(d) / "SUFFIX"
        suffix = suffix_file.read_text().strip() if suffix_file.exists() else SUFFIX
        name = "old" if len(dirs) == 1 else suffix[1:]
        if name in out or name in ("new", "adamw"):
            raise ValueError(f"--old-dir {d}: its packages' suffix {suffix!r} names another "
                             "version or AdamW's row; export each with its own --suffix")
        out[name] = (d, suffix, (pathlib.Path(d) / "COMMIT").read_text().strip())
    return out


def imported(directory: str, suffix: str):
    """The ``dion3_jax`` of an ``--export-to`` directory, imported as ``dion3_jax{suffix}``.
    The directory stays on ``sys.path``: the version's modules import lazily, at trace time."""
    sys.path.insert(0, directory)
    return importlib.import_module(f"dion3_jax{suffix}")


def working_tree_version() -> str:
    """``HEAD``'s short hash, with ``+changes`` when the packages differ from it."""
    if not (ROOT / ".git").exists():
        return "(no git history here)"
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", *PACKAGES],
                           capture_output=True, text=True, check=True).stdout.strip()
    return head + ("+changes" if dirty else "")


class Variant:
    """The working tree's ``dion3_jax`` with more ``scale_by_dion3`` options, timed as one more
    version (``new NAME``): a polar of ``bench_polar_steps.VARIANTS`` (``--polar``) or a momentum
    dtype (``--momentum``)."""

    def __init__(self, dion3, options: dict):
        self.__file__ = dion3.__file__
        self._dion3, self._options = dion3, options

    @classmethod
    def polar(cls, dion3, name: str) -> "Variant":
        from bench_polar_steps import VARIANTS

        return cls(dion3, {"orthogonalizer": dion3.make_orthogonalizer(**VARIANTS[name])})

    def scale_by_dion3(self, fraction, **kwargs):
        return self._dion3.scale_by_dion3(fraction, **(kwargs | self._options))


def stepper(dion3, fraction: float, params, grads, options=None, tx=None, mu_dtype=None):
    """Compiles one version's step (XLA compiler ``options``) and returns ``(run, cold
    start, memory)`` (``_model.ColdStart``: the seconds of trace, lowering and compile;
    :func:`step_memory`); ``tx`` replaces the version's transformation (the AdamW row);
    ``mu_dtype`` is passed to ``scale_by_dion3`` (None: its default).

    ``run()`` applies one step to this version's own copy of the parameters and its state (both
    donated and carried from call to call) and returns them.
    """
    if tx is None:
        kwargs = {} if mu_dtype is None else {"mu_dtype": mu_dtype}
        tx = optax.chain(dion3.scale_by_dion3(fraction, **kwargs), optax.scale(-1e-3))
    step, cold = _model.compile_step(tx, params, grads, options=options)
    memory = step_memory(step)
    check_fits(grads, memory[1], jax.devices()[0].memory_stats())
    carry = [jax.tree.map(jnp.copy, params), tx.init(params)]

    def run():
        carry[:] = step(carry[0], carry[1], grads)
        return carry
    return run, cold, memory


def check_fits(grads, peak_gib: float, stats: dict | None) -> None:
    """Raises ``MemoryError`` when a compiled step (``peak_gib``: :func:`step_memory`'s peak)
    cannot fit beside the steps already built: its arguments and temporaries less the
    gradients, which every version shares, against the device's free memory (``stats``:
    ``Device.memory_stats()``; no check where the backend gives none). Every version keeps its
    state on the device, so several large versions can exceed one GPU; without this check XLA's
    allocator waits and retries rather than fails."""
    if not stats or "bytes_limit" not in stats:
        return
    gib = 2.0**-30
    shared = sum(x.nbytes for x in jax.tree.leaves(grads)) * gib   # already on the device
    need = peak_gib - shared
    free = (stats["bytes_limit"] - stats.get("bytes_in_use", 0)) * gib
    if need > free:
        raise MemoryError(
            f"this step needs {need:.2f} GiB (its own parameters, state and temporaries) and "
            f"the device has {free:.2f} GiB free of {stats['bytes_limit'] * gib:.2f} GiB beside "
            "the steps already built: time fewer versions in one run")


def step_memory(compiled) -> tuple[float, float]:
    """``(state GiB, peak GiB)`` of a compiled step from XLA's memory analysis: the donated
    parameters and optimizer state it takes (arguments less the gradients, which are not
    donated, are counted as well), and those plus its temporaries (the step's peak on one
    device); NaN where the backend gives no analysis."""
    stats = compiled.memory_analysis()
    if stats is None:
        return float("nan"), float("nan")
    args = stats.argument_size_in_bytes
    return args / 2**30, (args + stats.temp_size_in_bytes) / 2**30


def time_fraction(versions: dict, fraction: float, params, grads, reps: int,
                  options=None, adamw=None, mu_dtype=None) -> dict:
    """Compiles every version's step at one fraction and times them in interleaved rounds
    (``adamw``: AdamW's step function, timed in the same rounds). Returns the fraction, each
    version's milliseconds (``ms``) and AdamW's (``adamw_ms``, or None)."""
    runs = {} if adamw is None else {"adamw": adamw}
    for name, dion3 in versions.items():
        runs[name], cold, (args_gib, peak_gib) = stepper(dion3, fraction, params, grads, options,
                                                          mu_dtype=mu_dtype)
        print(f"  f={fraction:g} {name}: cold start {cold.total:.1f} s (trace {cold.trace:.1f}, "
              f"lower {cold.lower:.1f}, compile {cold.compile:.1f}); arguments "
              f"{args_gib:.2f} GiB, with temporaries {peak_gib:.2f} GiB", flush=True)
    ms = median_ms_interleaved(runs, reps=reps)
    print(f"  f={fraction:g}: " + ", ".join(f"{n} {ms[n]:.2f} ms" for n in versions), flush=True)
    return {"fraction": fraction, "ms": {n: ms[n] for n in versions},
            "adamw_ms": ms.get("adamw")}


def print_table(rows: list[dict], names: list[str], adamw: bool) -> None:
    """The markdown table: per fraction, [AdamW's ms,] each version's ms [and its ratio to
    AdamW], then ``new / name`` for each older version and ``name / new`` for each variant
    (``new NAME``: ``--polar``, ``--momentum``)."""
    variants = [n for n in names if n.startswith("new ")]
    olds = [n for n in names if n != "new" and n not in variants]
    head = ["fraction"] + (["AdamW ms"] if adamw else [])
    for n in names:
        head += [f"{n} ms"] + ([f"{n} × AdamW"] if adamw else [])
    head += [f"new / {n}" for n in olds] + [f"{n} / new" for n in variants]
    print("| " + " | ".join(head) + " |")
    print("|" + "---:|" * len(head))
    for r in rows:
        ms = r["ms"]
        cells = [f"{r['fraction']:g}"] + ([f"{r['adamw_ms']:.2f}"] if adamw else [])
        for n in names:
            cells += [f"{ms[n]:.2f}"] + ([f"{ms[n] / r['adamw_ms']:.3f}"] if adamw else [])
        cells += [f"{ms['new'] / ms[n]:.3f}" for n in olds]
        cells += [f"{ms[n] / ms['new']:.3f}" for n in variants]
        print("| " + " | ".join(cells) + " |")


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--commit", default="b467ab5", help="the older version (default b467ab5)")
    p.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.25])
    p.add_argument("--reps", type=int, default=None, help="timed rounds (default 10; 3 small)")
    p.add_argument("--small", action="store_true", help="tiny model (CPU smoke check)")
    p.add_argument("--adamw", action="store_true", help="time optax.adamw in the same rounds")
    p.add_argument("--polar", nargs="+", default=[], metavar="VARIANT",
                   help="also the working tree with these polars of bench_polar_steps.py "
                        "(e.g. 'pe4+bound r-'), each one more version in the same rounds")
    p.add_argument("--momentum", nargs="+", default=[], metavar="DTYPE",
                   choices=["float32", "bfloat16", "float16"],
                   help="also the working tree with these momentum dtypes, each one more "
                        "version in the same rounds")
    p.add_argument("--mu-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="every version's momentum dtype (default: scale_by_dion3's)")
    p.add_argument("--export-to", default=None,
                   help="only export the old commit's renamed packages into this directory and "
                        "exit (for a copy of the repository without git history)")
    p.add_argument("--suffix", default=SUFFIX,
                   help="with --export-to: the exported packages' suffix (default _old); give "
                        "each directory that --old-dir takes together its own")
    p.add_argument("--old-dir", nargs="+", default=None,
                   help="import the older versions from directories made by --export-to "
                        "instead of exporting --commit")
    a = p.parse_args(argv)
    if a.export_to:
        export_dir(a.commit, pathlib.Path(a.export_to), a.suffix)
        return []
    cfg = _model.SMALL if a.small else _model.FULL
    reps = a.reps or (3 if a.small else 10)
    shapes = _model.model_shapes(**cfg)
    params = _model.make_tree(shapes, 0)
    grads = _model.make_tree(shapes, 1, 1e-3)
    # The old versions' modules are imported lazily too (at trace time): keep their files until
    # the end.
    with (tempfile.TemporaryDirectory(prefix="dion3_old_") as tmp,
          tempfile.TemporaryDirectory(prefix="dion3_autotune_") as tmp_cache):
        olds = (old_dirs(a.old_dir) if a.old_dir
                else {"old": (tmp, SUFFIX, export_old(a.commit, pathlib.Path(tmp)))})
        versions = {}
        for name, (d, suffix, _) in olds.items():
            versions[name] = imported(d, suffix)
        versions["new"] = importlib.import_module("dion3_jax")
        for name in a.polar:
            versions[f"new {name}"] = Variant.polar(versions["new"], name)
        for name in a.momentum:
            versions[f"new {name}"] = Variant(versions["new"], {"mu_dtype": jnp.dtype(name)})
        dev = jax.devices()[0]
        options = ({"xla_gpu_per_fusion_autotune_cache_dir": os.path.join(tmp_cache, "autotune")}
                   if dev.platform == "gpu" else None)
        described = ", ".join(f"{n} = {c}" for n, (_, _, c) in olds.items())
        print(f"# device: {dev.device_kind} ({dev.platform}); jax {jax.__version__}; model "
              f"{cfg['layers']} layers d={cfg['d']} ff={cfg['ff']}; {described} "
              f"({'--old-dir' if a.old_dir else a.commit}), new = the working tree at "
              f"{working_tree_version()} ({os.path.dirname(versions['new'].__file__)}); medians "
              f"of {reps} interleaved rounds; autotuning cache shared: {options is not None}",
              flush=True)
        adamw = (stepper(None, 0, params, grads, options, tx=optax.adamw(1e-3))[0]
                 if a.adamw else None)
        mu_dtype = None if a.mu_dtype is None else jnp.dtype(a.mu_dtype)
        rows = [time_fraction(versions, f, params, grads, reps, options, adamw, mu_dtype)
                for f in a.fractions]
    print()
    print_table(rows, list(versions), a.adamw)
    return rows


if __name__ == "__main__":
    main()
