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
"""Optimizer-step timings on the "7B-shapes" model, one device or FSDP.

The model (``_model.py``): 8 layers of Llama-7B matrices in Flax (in, out) layout, float32:
per layer four 4096×4096 (q, k, v, o), two 4096→11008 (gate, up) and one 11008→4096 (down);
1.62 B matrix parameters. Each variant is ``jit(update + apply_updates)`` with donated buffers, timed with
``jax.block_until_ready`` after a warm-up; medians of ``--reps`` runs, all variants in one run.
Each row also gives the "queued" time: ``--reps`` steps dispatched back to back, as a training
loop runs them, and one synchronization at the end, divided by ``--reps``. The host's dispatch
of a step then overlaps the device's run of the one before, so the queued time leaves out the
device's idle time between synchronized steps. On a GPU each row also gives the step's "device
ms": the summed duration of the GPU ops of one step (``_trace.device_ms``, a trace of 3
synchronized steps), and "host ms", the synchronized median minus it: the host's share of a
synchronized step (argument handling, the launch of the step's kernels and CUDA graphs before
the first op runs, the synchronization).
Every row also gives the variant's cold start: the seconds of ``jax.jit(step).trace`` (Python),
``.lower`` (StableHLO, including the Pallas kernels' lowering) and ``.compile`` (XLA, with the
kernels' own compilation), and their total (with ``--compile-workers`` the variants compile
concurrently, so each one's time includes waiting for the CPU); its memory on the first device:
the optimizer state's shards ("state MiB"), the temporary buffers of the compiled step beyond its
arguments and outputs ("temp MiB", from XLA's memory analysis) and the device's peak bytes in use
after the variant's runs ("peak MiB", ``device.memory_stats()["peak_bytes_in_use"]``, blank where
the device reports none; jax cannot reset it, so it is the process's running maximum and a row
shows its own peak only where it exceeds every earlier row's); and its collectives: counts per
kind, MiB sent per device and those MiB per element type ("by dtype": the wire format).

Variants: optax.adamw, optax.contrib.muon, and Dion3 (NorMuon flavor) at f ∈ {1, 1/2, 1/4, 1/8}
× {standard, Gram} Newton-Schulz × every matmul backend available on the device. For Dion3 the
table also gives the time of the batched polar calls alone (same shape groups and selected sizes
as the step) and the rest of the step (selection, gathers, scatters, NorMuon, elementwise).

``--fsdp``: every matrix is sharded along its output axis (``P(None, "fsdp")``, Flax layout) over
a 1-D Explicit mesh of all ``jax.devices()``; params, grads and state stay sharded, and Dion3 runs
its megabatched step (one all-to-all each way per shape group). ``optax.contrib.muon`` does not
run on matrices sharded under an Explicit mesh; it is then retried under an Auto mesh with the
same shardings (labeled "auto mesh"; XLA inserts whatever gathers it needs). ``--no-megabatch``
adds, per Dion3 variant, the same optimizer without megabatching: ``optax.partition`` gives every
parameter its own label and its own Dion3, so each parameter is a shape group of one (one
all-to-all each way per parameter; the same update). Polar-only timings are single-device and are
skipped with ``--fsdp`` and for the variants without megabatching. ``--xla-option NAME=VALUE``
adds, for AdamW and per megabatched Dion3 variant, the same step compiled with those XLA options
(that executable alone: ``compiler_options``), timed in the same process.

Every row also reports, from the compiled step's HLO (the per-device SPMD program): the number
of all-to-all, all-gather and all-reduce instructions (async ``-start`` forms counted once; other
collectives: reduce-scatter, collective-permute) and the bytes they move per step per device,
defined as the sum of the collectives' operand sizes.

Usage::

    python benchmarks/bench_step.py                     # the 7B-shapes model (GPU)
    python benchmarks/bench_step.py --small             # a tiny model, CPU smoke run
    python benchmarks/bench_step.py --fractions 1 0.25 --methods gram --backends xla
    python benchmarks/bench_step.py --fsdp --no-megabatch --fractions 1 0.25 --methods gram
    python benchmarks/bench_step.py --small --fsdp --no-megabatch --cpu-devices 8  # CPU smoke
    python benchmarks/bench_step.py --compile-workers 8 --no-polar   # every variant, one run
    python benchmarks/bench_step.py --fsdp --xla-option xla_gpu_enable_latency_hiding_scheduler=true
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import itertools
import os
import re
import signal
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

try:
    import dion3_jax
except ImportError:  # running from a source checkout
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import dion3_jax
from dion3_jax._selection import num_selected
import pallas_kernels
from _model import (FULL, SMALL, ColdStart, compile_step, dion3_step, fsdp_meshes, make_tree,
                    model_shapes, orthogonalizer, place, shape_bytes_by_dtype, xla_options)
from _timing import median_ms
from _trace import device_ms

COLLECTIVES = ("all-to-all", "all-gather", "all-reduce", "reduce-scatter", "collective-permute")


def collective_lines(hlo: str, per_kind: int = 4) -> list[str]:
    """The first ``per_kind`` instructions of each collective kind in compiled HLO text (each cut
    to 300 characters): what :func:`collective_stats` counted, to check its byte totals."""
    out = []
    for op in COLLECTIVES:
        hits = [ln.strip() for ln in hlo.splitlines()
                if re.search(rf"= .*? {op}(?:-start)?\(", ln)]
        out += [h[:300] for h in hits[:per_kind]]
    return out


def _collectives(hlo: str):
    """``(kind, operand bytes by dtype)`` of every collective instruction in compiled HLO.

    Async pairs count once (the ``-start``; ``-done`` is skipped). Operands are read from the
    instruction's argument list (compiled HLO prints operand shapes); where an operand's shape is
    not printed, the result's size is used instead.
    """
    for line in hlo.splitlines():
        for op in COLLECTIVES:
            m = re.search(rf"= (.*?) {op}(?:-start)?\((.*)$", line)
            if not m:
                continue
            depth, args = 1, ""
            for ch in m.group(2):
                depth += ch == "("
                depth -= ch == ")"
                if depth == 0:
                    break
                args += ch
            yield op, shape_bytes_by_dtype(args) or shape_bytes_by_dtype(m.group(1))
            break


def collective_stats(hlo: str) -> dict:
    """Per collective kind: instruction count and bytes (sum of operand sizes) in compiled HLO
    (see :func:`_collectives`)."""
    stats = {op: [0, 0] for op in COLLECTIVES}
    for op, by_dtype in _collectives(hlo):
        stats[op][0] += 1
        stats[op][1] += sum(by_dtype.values())
    return stats


def collective_bytes_by_dtype(hlo: str) -> dict[str, int]:
    """Bytes of all collectives' operands per element type (``{"f16": ..., "f32": ...}``): the
    wire format of the step's traffic."""
    out: dict[str, int] = {}
    for _, by_dtype in _collectives(hlo):
        for dt, n in by_dtype.items():
            out[dt] = out.get(dt, 0) + n
    return out


def peak_mib(device=None) -> float | None:
    """The device's peak bytes in use so far, in MiB (``memory_stats()["peak_bytes_in_use"]``),
    or None where the device reports no memory statistics (the CPU)."""
    device = jax.devices()[0] if device is None else device
    stats = device.memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / 2**20


def memory_mib(step, state) -> tuple[float, float | None]:
    """``(state, temp)`` in MiB on the first device: the optimizer state's shards there, and the
    temporary buffers XLA allocates for the compiled ``step`` beyond its arguments and outputs
    (None where the backend gives no memory analysis)."""
    dev = jax.devices()[0]
    state_bytes = sum(s.data.nbytes for x in jax.tree.leaves(state)
                      for s in x.addressable_shards if s.device == dev)
    analysis = step.memory_analysis()
    temp = None if analysis is None else analysis.temp_size_in_bytes / 2**20
    return state_bytes / 2**20, temp


def _abstract_state(tx, params, mesh=None):
    """``tx.init(params)`` as ShapeDtypeStructs; under a mesh with each leaf's real sharding (the
    state is built once on the devices and dropped), so a step compiled for it accepts the state
    :func:`time_step` builds."""
    if mesh is None:
        return None  # compile_step's jax.eval_shape: no device memory
    with jax.set_mesh(mesh):
        state = tx.init(params)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        state)


def time_step(tx, params, grads, reps: int, mesh=None, compiled=None,
              show_collectives: bool = False, options=None):
    """Times jit(update + apply_updates).

    Args:
      tx: the optax transformation.
      params, grads: parameter and gradient trees (placed as the step should see them).
      reps: timed runs.
      mesh: the mesh the step runs under, if any.
      compiled: :func:`compile_step`'s ``(executable, ColdStart)`` (or a future of it); compiled
        here if None.
      show_collectives: print the compiled step's first collective instructions.
      options: XLA compiler options (:func:`compile_step`), when compiled here.

    Returns:
      ``(median ms, queued ms, ColdStart, stats)``: the median of ``reps`` synchronized
      steps, the mean of ``reps`` steps dispatched back to back, the cold start's stages, and
      ``stats``: collective counts and bytes per kind (:func:`collective_stats`), collective
      bytes per dtype, the optimizer state's and the step's temporary memory on the first
      device (:func:`memory_mib`), the device time of one step (``device_ms``, None off GPU)
      and the device's peak memory after the runs (``peak_mib``, :func:`peak_mib`).
    """
    ctx = jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()
    with ctx:
        state = tx.init(params)
        params = jax.tree.map(jnp.copy, params)
        if compiled is None:
            compiled = compile_step(tx, params, grads, mesh, state, options)
        step, cold = compiled.result() if hasattr(compiled, "result") else compiled
        hlo = step.as_text()
        state_mib, temp_mib = memory_mib(step, state)
        stats = {"collectives": collective_stats(hlo), "by_dtype": collective_bytes_by_dtype(hlo),
                 "state_mib": state_mib, "temp_mib": temp_mib}
        if show_collectives:
            for line in collective_lines(hlo):
                print(f"    | {line}", flush=True)
        for _ in range(2):  # warm-up
            params, state = jax.block_until_ready(step(params, state, grads))
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            params, state = jax.block_until_ready(step(params, state, grads))
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(reps):
            params, state = step(params, state, grads)
        jax.block_until_ready((params, state))
        queued = (time.perf_counter() - t0) / reps
        carried = [params, state]

        def advance():  # one step on the carried (donated) buffers
            carried[:] = step(carried[0], carried[1], grads)
            return carried

        stats["device_ms"] = device_ms(advance, reps=3)
        stats["peak_mib"] = peak_mib()
        del params, state, carried
    return statistics.median(times) * 1e3, queued * 1e3, cold, stats


def time_polar(shapes, fraction: float, ortho, reps: int) -> float:
    """The step's polar work alone: one batched call per (wide shape) group of selected rows."""
    groups: dict[tuple[int, int], int] = {}
    for fan_in, fan_out in shapes.values():
        k = num_selected(fraction, fan_out)
        groups[tuple(sorted((k, fan_in)))] = groups.get(tuple(sorted((k, fan_in))), 0) + 1
    xs = [jax.random.normal(jax.random.key(i), (c, a, b), jnp.float32)
          for i, ((a, b), c) in enumerate(groups.items())]
    fn = jax.jit(lambda xs: [ortho(x) for x in xs])
    return median_ms(fn, xs, reps=reps)


class _Stopped(Exception):
    pass


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="tiny model (CPU smoke check)")
    p.add_argument("--reps", type=int, default=None, help="timed runs per variant (default 10)")
    p.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.5, 0.25, 0.125])
    p.add_argument("--methods", nargs="+", default=["standard", "gram"],
                   choices=["standard", "gram"])
    p.add_argument("--backends", nargs="+", default=None,
                   help="matmul backends (default: every available one)")
    p.add_argument("--pass-implementations", nargs="+", default=["auto"],
                   choices=["auto", "xla", "mosaic", "pallas_triton"],
                   help="the memory-bound passes' implementations to time (default: auto)")
    p.add_argument("--no-baselines", action="store_true", help="skip adamw and optax muon")
    p.add_argument("--no-polar", action="store_true", help="skip the polar-only timings")
    p.add_argument("--fsdp", action="store_true",
                   help="shard every matrix along its output axis over all devices (1-D mesh)")
    p.add_argument("--no-megabatch", action="store_true",
                   help="also time each Dion3 variant without megabatching (one Dion3 per "
                        "parameter through optax.partition: one all-to-all pair per parameter)")
    p.add_argument("--show-collectives", action="store_true",
                   help="print each variant's first collective instructions (compiled HLO)")
    p.add_argument("--compile-workers", type=int, default=0, metavar="N",
                   help="compile every variant up front on N threads (XLA compiles in "
                        "parallel, so all variants fit one time-limited run), then time them in "
                        "order; 0: compile each just before timing it")
    p.add_argument("--xla-option", action="append", default=[], metavar="NAME=VALUE",
                   help="also time AdamW and every Dion3 variant compiled with this XLA option "
                        "(repeat for several options, all applied together to that second "
                        "build; e.g. xla_gpu_enable_latency_hiding_scheduler=true)")
    p.add_argument("--cpu-devices", type=int, default=None,
                   help="simulate this many CPU devices (jax_num_cpu_devices; CPU smoke runs)")
    return p.parse_args(argv)


def build_plan(a, shapes, backends) -> list[tuple]:
    """Every variant: ``(name, optax transformation, (method, backend, f, megabatch) or None,
    XLA options)``; the baselines (AdamW also with ``--xla-option``'s options, if any), the
    megabatched Dion3 variants (each also with those options), then those without
    megabatching."""
    plan = []
    extra = xla_options(a.xla_option)
    builds = [("", {})] + ([(" [" + " ".join(a.xla_option) + "]", extra)] if extra else [])
    if not a.no_baselines:
        plan += [("optax.adamw" + suffix, optax.adamw(1e-3), None, options)
                 for suffix, options in builds]
        plan.append(("optax.contrib.muon", optax.contrib.muon(1e-3), None, {}))
    for megabatch in [True] + ([False] if a.no_megabatch else []):
        for method in a.methods:
            for backend, passes in itertools.product(backends, a.pass_implementations):
                for f in a.fractions:
                    for suffix, options in builds if megabatch else builds[:1]:
                        name = (f"dion3 f={f:g} {method} {backend}"
                                + ("" if passes == "auto" else f" passes={passes}")
                                + ("" if megabatch else " no-megabatch") + suffix)
                        per_leaf = None if megabatch else sorted(shapes)
                        plan.append((name, dion3_step(f, method, backend, per_leaf, passes),
                                     (method, backend, f, megabatch), options))
    return plan


def compile_all(plan, workers: int, params, grads, mesh) -> dict:
    """Every variant compiled up front on ``workers`` threads: name → future of
    :func:`compile_step`'s result (all done when this returns)."""
    pool = concurrent.futures.ThreadPoolExecutor(workers)
    compiled = {name: pool.submit(compile_step, tx, params, grads, mesh,
                                  _abstract_state(tx, params, mesh), options)
                for name, tx, _, options in plan}
    t0 = time.perf_counter()
    pool.shutdown(wait=True)  # All compiled before any timing: no compile threads compete.
    print(f"# compiled {len(plan)} variants on {workers} threads in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    return compiled


def row(name, ms, queued_ms, cold: ColdStart, stats, polar_ms=None) -> dict:
    """One table row, also printed as a progress line."""
    extra = "" if polar_ms is None else f"  (polar {polar_ms:.2f} ms)"
    coll = ", ".join(f"{op} {c}×/{b / 2**20:.2f} MiB"
                     for op, (c, b) in stats["collectives"].items() if c)
    dev = stats.get("device_ms")
    on_gpu = "" if dev is None else f", {dev:.2f} on the device"
    print(f"  {name}: {ms:.2f} ms ({queued_ms:.2f} queued{on_gpu}), cold start "
          f"{cold.total:.1f} s (trace {cold.trace:.1f}, lower {cold.lower:.1f}, compile "
          f"{cold.compile:.1f}){extra}  [{coll or 'no collectives'}]", flush=True)
    return {"variant": name, "ms": ms, "queued_ms": queued_ms, "compile_s": cold.total,
            "cold": cold, "polar_ms": polar_ms, "stats": stats}


def print_table(rows) -> None:
    adamw = next((r for r in rows if r["variant"] == "optax.adamw"), None)
    print()
    print("| step | ms (median) | × AdamW | queued ms | × AdamW queued | device ms | "
          "× AdamW device | host ms | trace s | lower s | compile s | cold start s | "
          "× AdamW cold start | polar ms | rest ms | state MiB | temp MiB | peak MiB | "
          "all-to-all | all-gather | all-reduce | other coll. | MiB moved / device | by dtype |")
    print("|---|" + "---:|" * 22 + "---|")
    for r in rows:
        rel = f"{r['ms'] / adamw['ms']:.2f}" if adamw else "–"
        rel_q = f"{r['queued_ms'] / adamw['queued_ms']:.2f}" if adamw else "–"
        dev, dev_a = r["stats"].get("device_ms"), adamw and adamw["stats"].get("device_ms")
        device = "–" if dev is None else f"{dev:.2f}"
        rel_d = f"{dev / dev_a:.2f}" if dev is not None and dev_a else "–"
        host = "–" if dev is None else f"{r['ms'] - dev:.2f}"
        pol = f"{r['polar_ms']:.2f}" if r["polar_ms"] is not None else "–"
        rest = f"{r['ms'] - r['polar_ms']:.2f}" if r["polar_ms"] is not None else "–"
        st = r["stats"]["collectives"]
        other = sum(st[op][0] for op in COLLECTIVES[3:])
        moved = sum(b for _, b in st.values()) / 2**20
        temp, peak = r["stats"]["temp_mib"], r["stats"].get("peak_mib")
        cold = r["cold"]
        rel_c = f"{cold.total / adamw['cold'].total:.2f}" if adamw else "–"
        dtypes = ", ".join(f"{dt} {b / 2**20:.2f}"
                           for dt, b in sorted(r["stats"]["by_dtype"].items())) or "–"
        print(f"| {r['variant']} | {r['ms']:.2f} | {rel} | {r['queued_ms']:.2f} | {rel_q} | "
              f"{device} | {rel_d} | {host} | {cold.trace:.2f} | {cold.lower:.2f} | "
              f"{cold.compile:.2f} | {cold.total:.2f} | {rel_c} | {pol} | {rest} | "
              f"{r['stats']['state_mib']:.1f} | {'–' if temp is None else f'{temp:.1f}'} | "
              f"{'' if peak is None else f'{peak:.1f}'} | "
              f"{st['all-to-all'][0]} | "
              f"{st['all-gather'][0]} | {st['all-reduce'][0]} | {other} | {moved:.2f} | "
              f"{dtypes} |")


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    if a.cpu_devices:
        jax.config.update("jax_num_cpu_devices", a.cpu_devices)
    cfg = SMALL if a.small else FULL
    reps = a.reps or (3 if a.small else 10)
    backends = a.backends or [b for b in pallas_kernels.available_implementations()
                              if b in ("xla", "mosaic", "jax_triton")]
    shapes = model_shapes(**cfg)
    n_params = sum(int(np.prod(s)) for s in shapes.values())
    params, grads = make_tree(shapes, 0), make_tree(shapes, 1, 1e-3)
    mesh = auto_mesh = None
    if a.fsdp:
        mesh, auto_mesh = fsdp_meshes(shapes)
        params, grads = place(params, mesh), place(grads, mesh)
    dev = jax.devices()[0]
    where = (f"FSDP over {len(jax.devices())} devices (P(None, 'fsdp'), Explicit mesh)"
             if a.fsdp else "one device")
    print(f"# device: {dev.device_kind} ({dev.platform}); jax {jax.__version__}; model "
          f"{cfg['layers']} layers d={cfg['d']} ff={cfg['ff']} ({n_params / 1e9:.3f} B matrix "
          f"params, float32); {where}; medians of {reps}", flush=True)
    plan = build_plan(a, shapes, backends)
    compiled = (compile_all(plan, a.compile_workers, params, grads, mesh)
                if a.compile_workers > 0 else {})
    rows = []

    def variants():
        for name, tx, dion, options in plan:
            try:
                ms, queued_ms, cold, stats = time_step(
                    tx, params, grads, reps, mesh, compiled=compiled.get(name),
                    show_collectives=a.show_collectives, options=options)
            except Exception as e:  # noqa: BLE001 - optax muon, sharded under an Explicit mesh
                if name != "optax.contrib.muon" or mesh is None:
                    raise
                print(f"  optax.contrib.muon failed under the Explicit mesh "
                      f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); retrying under an "
                      f"Auto mesh", flush=True)
                rows.append(row(f"{name} (auto mesh)", *time_step(
                    tx, place(params, auto_mesh), place(grads, auto_mesh), reps, auto_mesh)))
                continue
            polar_ms = None
            if dion is not None and not (a.no_polar or a.fsdp or not dion[3] or options):
                method, backend, f, _ = dion
                polar_ms = time_polar(shapes, f, orthogonalizer(method, backend), reps)
            rows.append(row(name, ms, queued_ms, cold, stats, polar_ms))

    # A SIGTERM (e.g. from `timeout`) stops the measurements; the table of the rows done so far
    # is still printed.
    def stop(signum, frame):
        raise _Stopped
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        variants()
    except _Stopped:
        print("# stopped by SIGTERM: the table below has the rows done so far", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print_table(rows)
    return rows


if __name__ == "__main__":
    main()
