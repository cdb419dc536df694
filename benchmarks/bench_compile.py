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
"""Compile time of one optimizer step: optax.adamw against Dion3, as the model gets deeper.

The model is the benchmarks' (``_model.py``: per layer four d×d, two d→ff and one ff→d
matrices, float32, Flax layout) with ``--layers`` layers, as abstract ``ShapeDtypeStruct``
leaves: nothing is allocated, so the 7B shapes run on any machine. Each variant is
``jit(update + apply_updates)`` with donated params and state (``_model.jitted_step``, as in
``bench_step.py``); the table gives the seconds of its three stages, ``jax.jit(...).trace`` (Python), ``.lower`` (StableHLO) and
``.compile`` (XLA), their total and the total as a multiple of AdamW's at the same depth.
With ``--xla-option NAME=VALUE`` every variant is also compiled with those XLA options (rows
marked ``+opts``, each against AdamW's compile with the same options): on a GPU,
``xla_gpu_autotune_level=0`` shows the share of XLA's GEMM autotuning.

Dion3 is ``dion3_jax.dion3`` with its defaults (NorMuon, Gram Newton-Schulz in float16) at each
``--fractions`` value. The XLA compile time depends on the backend (``jax.default_backend()``,
printed first) and on how busy the machine is; run it alone. With ``--repeats N`` every variant
is compiled N times in interleaved rounds (AdamW, then each Dion3 variant, N times over; each
round traces anew, so nothing is cached) and a last row per variant gives the median of each
stage, the median total and the ratio of the median totals: on a machine whose speed drifts,
one compile of AdamW is a noisy unit.

With ``--ops N`` the table is instead the compile time of each kind of per-matrix pass the step
holds, for one 4096×4096 matrix (and ``--d`` as its size): ``N`` independent instances in one
jitted function, compiled once (XLA:CPU compiles every instance's kernel on its own), in
milliseconds per instance, with the fusions per instance. It shows which passes a deep model's
compile pays for per matrix.

With ``--no-kernel-rows`` each Dion3 step is also compiled with no kernel (``no kernels``:
the polar's products and both passes in XLA); on a GPU the difference of the two rows is what
the Mosaic GPU kernels cost in each stage (their lowering, and their compile, which jaxlib
does when XLA instantiates the executable).

With ``--mu-dtypes DTYPE ...`` each Dion3 step is also compiled with those momentum dtypes
(``mu=bfloat16``: a 16-bit momentum, rounded stochastically, whose step hashes random bits).

With ``--cache-dir DIR`` every compile goes through JAX's persistent compilation cache in
``DIR`` (every executable written, whatever its compile time and size). Run the same command
twice: the first run fills the cache, the second one's compile stage is what a repeated run pays
with a warm cache (it still traces and lowers).

With ``--first-call`` the model is also allocated (random leaves) and each compiled step run
twice: a line per variant gives the seconds of its first and second call. The first call is where
jaxlib instantiates the executable, so with ``--cache-dir`` it shows whether a warm cache's
executable still pays for its kernels on the way to the first step.

With ``--lower-for-h200`` the step is traced and lowered for an NVIDIA H200 (an abstract
device: no GPU is needed, and nothing is compiled), as the first two stages of the GPU's cold
start; the table then gives those two stages and the number of Mosaic GPU kernels in the
lowered module (each adds its own lowering), for the default step and for the step with every
product and pass in XLA (``no kernels``): the difference is the kernels' lowering. With
``--list-kernels`` each variant's kernels follow the table, one line each: the jitted wrapper
that holds it, and its operand and result types.

Usage::

    python benchmarks/bench_compile.py                         # 8 and 32 layers, f = 1 and 1/4
    python benchmarks/bench_compile.py --layers 8 32 96 --fractions 1 0.25
    python benchmarks/bench_compile.py --layers 96 --fractions 0.25 --repeats 3
    python benchmarks/bench_compile.py --layers 2 --d 64 --ff 176   # a small smoke run
    python benchmarks/bench_compile.py --layers 8 --fractions 1 0.25 --lower-for-h200
    python benchmarks/bench_compile.py --layers 8 --fractions 0.25 --lower-for-h200 --list-kernels
    python benchmarks/bench_compile.py --layers 8 --xla-option xla_gpu_autotune_level=0  # GPU
    python benchmarks/bench_compile.py --ops 40             # compile ms per per-matrix pass
    python benchmarks/bench_compile.py --layers 8 --cache-dir DIR   # twice: cold, then warm
    python benchmarks/bench_compile.py --layers 8 --cache-dir DIR --first-call   # and run it
    python benchmarks/bench_compile.py --layers 8 --fractions 0.25 --no-kernel-rows   # GPU
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh
import optax

try:
    import dion3_jax
except ImportError:  # running from a source checkout
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import dion3_jax
import pallas_kernels
from dion3_jax import _selection
from _model import compile_step, jitted_step, make_tree, model_shapes, xla_options

H200 = AbstractDevice("NVIDIA H200", 132, "gpu")


def first_calls(compiled, tx: optax.GradientTransformation, shapes) -> tuple[float, float]:
    """Seconds of the first and of the second call of a compiled step (``_model.jitted_step``'s
    signature) on random leaves of ``shapes``, each synchronized."""
    params, grads = make_tree(shapes, 0), make_tree(shapes, 1, 0.01)
    state = jax.block_until_ready(tx.init(params))
    seconds = []
    for _ in range(2):
        t0 = time.perf_counter()
        params, state = jax.block_until_ready(compiled(params, state, grads))
        seconds.append(time.perf_counter() - t0)
    return seconds[0], seconds[1]


def use_persistent_cache(directory: str) -> None:
    """Sends every later compile of this process through JAX's persistent compilation cache in
    ``directory``: each executable is written there, and read back by a later process that
    compiles the same program (docs/TRAINING.md)."""
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def h200_lowering(tx: optax.GradientTransformation, params
                  ) -> tuple[float, float, list[str]]:
    """Seconds to trace and lower ``jit(update + apply_updates)`` for an abstract H200, and the
    Mosaic GPU kernels in the lowered module (:func:`mosaic_kernels`)."""
    mesh = AbstractMesh((1,), ("x",), axis_types=(AxisType.Explicit,), abstract_device=H200)
    with use_abstract_mesh(mesh):
        state = jax.eval_shape(tx.init, params)
        t0 = time.perf_counter()
        traced = jitted_step(tx).trace(params, state, params)
        t1 = time.perf_counter()
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1, mosaic_kernels(text)


def mosaic_kernels(text: str) -> list[str]:
    """Per Mosaic GPU call of a lowered module's text: the name of the function that holds it
    (the kernel's jitted wrapper) and its operand and result types. Each is lowered once, however
    many times the step calls its wrapper."""
    out, func = [], "?"
    for line in text.splitlines():
        if m := re.match(r"\s*func\.func (?:private |public )?@([\w.$-]+)", line):
            func = m.group(1)
        elif "custom_call @mosaic_gpu" in line:
            out.append(f"{func} {line.rsplit(' : ', 1)[-1].strip()}")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.25])
    ap.add_argument("--d", type=int, default=4096, help="model width")
    ap.add_argument("--ff", type=int, default=11008, help="MLP width")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--repeats", type=int, default=1, help="interleaved rounds (default 1)")
    ap.add_argument("--xla-option", action="append", default=[], metavar="NAME=VALUE",
                    help="also compile every variant with these XLA options (repeatable), "
                         "e.g. xla_gpu_autotune_level=0 for the autotuner's share")
    ap.add_argument("--lower-for-h200", action="store_true",
                    help="trace and lower for an abstract H200 only; count Mosaic GPU kernels")
    ap.add_argument("--list-kernels", action="store_true",
                    help="with --lower-for-h200: also list each variant's Mosaic GPU kernels "
                         "(wrapper name, operand and result types)")
    ap.add_argument("--ops", type=int, default=0, metavar="N",
                    help="instead: compile ms per instance of each per-matrix pass (N of each)")
    ap.add_argument("--no-kernel-rows", action="store_true",
                    help="also compile each Dion3 step with no kernel (its products and passes "
                         "in XLA): the difference is the kernels' share of every stage")
    ap.add_argument("--first-call", action="store_true",
                    help="also allocate the model and time each compiled step's first and "
                         "second call")
    ap.add_argument("--mu-dtypes", nargs="+", default=[], metavar="DTYPE",
                    choices=["float32", "bfloat16", "float16"],
                    help="also compile (or, with --lower-for-h200, lower) each Dion3 step with "
                         "these momentum dtypes (rows marked mu=DTYPE; a 16-bit one is rounded "
                         "stochastically)")
    ap.add_argument("--cache-dir", metavar="DIR",
                    help="compile through JAX's persistent compilation cache in DIR (run "
                         "twice: the second run's compile stage is a warm cache's)")
    a = ap.parse_args(argv)
    if a.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {a.repeats}")
    if a.cache_dir:
        use_persistent_cache(a.cache_dir)
    if a.ops:
        return _ops_table(a.ops, a.d)
    if a.lower_for_h200:
        return _h200_table(a)
    options = xla_options(a.xla_option)
    print(f"backend: {jax.default_backend()}; d={a.d}, ff={a.ff}; seconds")
    print(f"{'layers':>6} {'optimizer':<29} {'trace':>7} {'lower':>7} {'compile':>8} "
          f"{'total':>8} {'× AdamW':>8}")
    for layers in a.layers:
        shapes = model_shapes(layers, a.d, a.ff)
        params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
        # Each row's unit is AdamW compiled with the same options (the "adamw" of its tag).
        builds = [("", None)] + ([(" +opts", options)] if options else [])
        variants = [("adamw" + tag, tag, optax.adamw(a.lr), opts) for tag, opts in builds]
        kinds = list(_KERNEL_VARIANTS if a.no_kernel_rows else _KERNEL_VARIANTS[:1])
        kinds += [(f" mu={dt}", {"mu_dtype": jnp.dtype(dt)}) for dt in a.mu_dtypes]
        variants += [(f"dion3 f={f:g}{kind}" + tag, tag, dion3_jax.dion3(a.lr, f, **kw), opts)
                     for tag, opts in builds for f in a.fractions for kind, kw in kinds]
        runs = {name: [] for name, *_ in variants}
        for _ in range(a.repeats):
            for name, tag, tx, opts in variants:
                compiled, stages = compile_step(tx, params, params, options=opts)
                runs[name].append(tuple(stages))
                _print_row(layers, name, runs[name][-1], sum(runs[name][-1]),
                           sum(runs["adamw" + tag][-1]))
                if a.first_call:
                    first, second = first_calls(compiled, tx, shapes)
                    print(f"{'':>6} {name:<29} first call {first:.6f} s, second {second:.6f} s",
                          flush=True)
                del compiled
        if a.repeats > 1:
            totals = {name: statistics.median(map(sum, r)) for name, r in runs.items()}
            for name, tag, *_ in variants:
                _print_row(layers, f"{name} (median)",
                           [statistics.median(x) for x in zip(*runs[name])], totals[name],
                           totals["adamw" + tag])


#: Each Dion3 step's variants for ``--lower-for-h200`` and ``--no-kernel-rows``: the defaults,
#: and the step with no kernel (the polar's products and both passes in XLA), whose difference
#: is the kernels' share of each stage.
_KERNEL_VARIANTS = (("", {}), (" no kernels", dict(
    pass_implementation="xla", orthogonalizer=dion3_jax.make_orthogonalizer(backend="xla"))))


def _h200_table(a) -> None:
    """The ``--lower-for-h200`` table: per depth and variant, trace and lowering seconds (and
    medians over ``--repeats`` interleaved rounds) and the Mosaic GPU kernel count."""
    print(f"lowered for an abstract NVIDIA H200 on {jax.default_backend()}; d={a.d}, ff={a.ff}; "
          "seconds")
    print(f"{'layers':>6} {'optimizer':<34} {'trace':>7} {'lower':>7} {'kernels':>8}")
    for layers in a.layers:
        params = {k: jax.ShapeDtypeStruct(s, jnp.float32)
                  for k, s in model_shapes(layers, a.d, a.ff).items()}
        kinds = list(_KERNEL_VARIANTS) + [(f" mu={dt}", {"mu_dtype": jnp.dtype(dt)})
                                          for dt in a.mu_dtypes]
        variants = [(f"dion3 f={f:g}{tag}", dion3_jax.dion3(a.lr, f, **kw))
                    for f in a.fractions for tag, kw in kinds]
        runs = {name: [] for name, _ in variants}
        for _ in range(a.repeats):
            for name, tx in variants:
                runs[name].append(h200_lowering(tx, params))
                trace, lower, kernels = runs[name][-1]
                print(f"{layers:>6} {name:<34} {trace:7.2f} {lower:7.2f} {len(kernels):>8}",
                      flush=True)
        for name, r in runs.items() if a.repeats > 1 else ():
            trace, lower = (statistics.median(x[i] for x in r) for i in (0, 1))
            print(f"{layers:>6} {name + ' (median)':<34} {trace:7.2f} {lower:7.2f} "
                  f"{len(r[0][2]):>8}", flush=True)
        for name, r in runs.items() if a.list_kernels else ():
            print(f"\n{layers} layers, {name}: {len(r[0][2])} Mosaic GPU kernels")
            for kernel in r[0][2]:
                print(f"  {kernel}")


def _per_matrix_passes(d: int) -> dict:
    """Per kind of per-matrix pass: ``(function of N matrices' inputs, one matrix's inputs)``,
    the passes in the step's form (a quarter of the rows selected; rows along the minor axis,
    as in Flax's layout)."""
    m, k = jax.ShapeDtypeStruct((1, d, d), jnp.float32), d // 4
    row = jax.ShapeDtypeStruct((1, 1, d), jnp.float32)
    idx, keep = (jax.ShapeDtypeStruct((1, n), t) for n, t in ((k, jnp.int32), (d, jnp.bool_)))
    dirs = jax.ShapeDtypeStruct((1, d, k), jnp.float32)
    return {
        "S = d ⊙ M + G": (lambda m, g, s: pallas_kernels.scaled_sum(m, g, s), (m, m, row)),
        "S and its two row sums": (lambda m, g, s: pallas_kernels.accumulate_rows_reference(
            m, g, s[:, 0], row_axis=2)[1:], (m, m, row)),
        "payload gather S[:, I] → f16": (lambda s, i: (_selection.gather_rows(s, i, 2) / 3.0
                                                       ).astype(jnp.float16), (m, idx)),
        "update gather + parameter": (lambda p, o, i, keep: p - 0.01 * _selection.place_rows(
            o, (i, keep), 2), (m, dirs, jax.ShapeDtypeStruct((1, d), jnp.int32), keep)),
        "AdamW's update": (lambda p, g, mu, nu: (p - 0.01 * mu / (jnp.sqrt(nu) + 1e-8),
                                                 0.9 * mu + 0.1 * g, 0.99 * nu + 0.01 * g * g),
                           (m, m, m, m)),
        "slice of a per-group array": (lambda x, o: 2.0 * jax.lax.dynamic_slice_in_dim(
            x, o, 1), (jax.ShapeDtypeStruct((8, d), jnp.float32), np.int32(3))),
    }


def _ops_table(n: int, d: int) -> None:
    """The ``--ops`` table: per pass, the compile time of ``n`` independent instances."""
    print(f"backend: {jax.default_backend()}; {d}×{d} matrices, {n} instances per row")
    print(f"{'pass':<32} {'ms per instance':>16} {'fusions':>8}")
    for name, (fn, args) in _per_matrix_passes(d).items():
        many = jax.jit(lambda *xs: [fn(*x) for x in xs])
        lowered = many.lower(*[args] * n)
        t0 = time.perf_counter()
        text = lowered.compile().as_text()
        ms = (time.perf_counter() - t0) * 1000 / n
        fusions = text[text.index("ENTRY"):].count(" fusion(") / n
        print(f"{name:<32} {ms:16.2f} {fusions:8.1f}", flush=True)


def _print_row(layers: int, name: str, stages, total: float, adamw_total: float) -> None:
    """One table row: the three stages' seconds, the total and the total over AdamW's."""
    print(f"{layers:>6} {name:<29} {stages[0]:7.2f} {stages[1]:7.2f} {stages[2]:8.2f} "
          f"{total:8.2f} {total / adamw_total:8.1f}", flush=True)


if __name__ == "__main__":
    main()
