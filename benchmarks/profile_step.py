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
"""Where the time of one optimizer step goes: a ``jax.profiler`` trace of the 7B-shapes step
(the benchmarks' model, ``_model.py``), summed per device op and per op kind, printed as tables.

On a GPU the ops are those of the device plane's "XLA Ops" line (HLO instruction names such as
``scatter.12``, ``fusion.3``, ``sort.1`` or a Pallas kernel's name); on CPU the host plane's XLA
events stand in (a smoke check of the script, not a profile worth reading).

With ``--fsdp`` (``_model.place``'s sharding over all devices) the trace also gives, per
collective op on the first device, when it ran and how much of it overlapped compute ops on other
streams of that device: the evidence of whether the shape groups' all-to-alls hide behind other
groups' polar work.

With ``--queued`` the traced steps are dispatched back to back and synchronized once, as a
training loop runs them: the idle time between ops is then where the host fell behind the GPU
(by default every step is synchronized, so the idle time before each step's first op is the
host's dispatch).

With ``--host`` the trace is taken without the Python tracer, and the script also lists what the
host did while the GPU sat idle before each traced step's first op (the events of the host
planes that overlap those gaps, summed per name; nested events each count their own time): the
host's share of a synchronized step. ``--optimizer adamw`` profiles ``optax.adamw``'s step on the
same model, the baseline the targets are stated against.

With ``--old-dir`` the Dion3 step of older versions (exported by ``bench_commits.py
--export-to``, each with its default options) is profiled first, in the same process on the
same leaves, a set of tables each: a pass that a change removed shows in the old version's
tables and not in the new one's.

Usage::

    python benchmarks/profile_step.py --fraction 0.25            # 7B shapes, one device
    python benchmarks/profile_step.py --fraction 0.25 --host     # and the host before each step
    python benchmarks/profile_step.py --fraction 0.25 --queued   # steps back to back
    python benchmarks/profile_step.py --fraction 0.25 --mu-dtype float16  # 16-bit momentum
    python benchmarks/profile_step.py --optimizer adamw --host   # the baseline's step
    python benchmarks/profile_step.py --small --fraction 0.25    # CPU smoke run
    python benchmarks/profile_step.py --fraction 1 --old-dir DIR  # an older version, then this
    python benchmarks/profile_step.py --fsdp --fraction 0.25 \
        --xla-option xla_gpu_enable_latency_hiding_scheduler=true   # several GPUs
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gzip
import json
import os
import re
import sys
import tempfile

import jax
import optax
from jax.profiler import ProfileData

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import _model  # noqa: E402  (model shapes, parameter trees, the Dion3 step)
from bench_commits import imported, old_dirs  # noqa: E402
from _trace import SUMMARY_LINES, first_gpu, load_trace, op_lines  # noqa: E402


def op_times(data: ProfileData) -> dict[str, float]:
    """Total nanoseconds per op name on the first GPU (the host plane on CPU)."""
    totals: dict[str, float] = collections.defaultdict(float)
    plane = first_gpu(data)
    if plane is not None:
        for line in op_lines(plane):
            for event in line.events:
                totals[event.name] += event.duration_ns
    else:
        for line in data.find_plane_with_name("/host:CPU").lines:
            if line.name.startswith("tf_XLA"):
                for event in line.events:
                    if not event.name.startswith(("ThreadpoolListener", "end:")):
                        totals[event.name] += event.duration_ns
    return totals


def _idle(data: ProfileData) -> list[tuple[int, int, str, str]]:
    """The first GPU's idle stretches (its :func:`op_lines` merged into one timeline): ``(start
    ns, end ns, name of the op that ended it, name of the op before it)`` for every gap between
    consecutive ops (empty on CPU)."""
    plane = first_gpu(data)
    if plane is None:
        return []
    out, end, last = [], None, ""
    for e in sorted((e for line in op_lines(plane) for e in line.events),
                    key=lambda e: e.start_ns):
        if end is not None and e.start_ns > end:
            out.append((end, e.start_ns, e.name, last))
        if e.start_ns + e.duration_ns >= (end or 0):
            end, last = e.start_ns + e.duration_ns, e.name
    return out


def device_gaps(data: ProfileData) -> list[tuple[float, str, str]]:
    """``(ns idle, name of the op that ended it, name of the op before it)`` for every idle
    stretch of the first GPU."""
    return [(end - start, name, before) for start, end, name, before in _idle(data)]


def idle_windows(data: ProfileData, min_ns: float = 2e5) -> list[tuple[int, int]]:
    """``(start, end)`` of the first GPU's idle stretches of at least ``min_ns``: in a trace of
    synchronized steps, the host's time before each step's first op."""
    return [(start, end) for start, end, *_ in _idle(data) if end - start >= min_ns]


def host_in_windows(data: ProfileData, windows) -> dict[str, tuple[float, int]]:
    """Per host event name: ``(ns inside the windows, events)`` over the host planes' lines."""
    out: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for plane in data.planes:
        if not plane.name.startswith("/host"):
            continue
        for line in plane.lines:
            for e in line.events:
                inside = _covered(e.start_ns, e.start_ns + e.duration_ns, windows)
                if inside > 0:
                    out[e.name][0] += inside
                    out[e.name][1] += 1
    return {k: (v[0], v[1]) for k, v in out.items()}


def print_host(data: ProfileData, top: int) -> None:
    """The GPU's idle windows before the traced steps and the host events inside them."""
    windows = idle_windows(data)
    if not windows:
        print("\n# no GPU idle window of ≥ 0.2 ms in the trace")
        return
    mean = sum(e - s for s, e in windows) / len(windows) / 1e6
    print(f"\n# GPU idle before a step's first op: {mean:.2f} ms on average over "
          f"{len(windows)} windows; host events inside them (ms per window, events):")
    print("\n| host event | ms | events |\n|---|---:|---:|")
    rows = sorted(host_in_windows(data, windows).items(), key=lambda kv: -kv[1][0])
    for name, (ns, n) in rows[:top]:
        print(f"| {name[:80]} | {ns / len(windows) / 1e6:.3f} | {n} |")


COLLECTIVE = re.compile(r"all-to-all|all-reduce|all-gather|reduce-scatter|collective-permute"
                        r"|nccl", re.IGNORECASE)


def _merge(intervals):
    """Sorted, disjoint union of ``(start, end)`` intervals."""
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def _covered(start, end, union) -> float:
    """Nanoseconds of ``[start, end)`` inside the disjoint sorted intervals ``union``."""
    return sum(max(0, min(end, e) - max(start, s)) for s, e in union)


def collective_overlap(data: ProfileData):
    """Per collective op of the first GPU: ``(name, line, start ns from the plane's first op,
    ns, ns overlapped by non-collective ops on the plane's other lines, the three ops that
    overlap it most)``, in time order; empty on CPU or without collectives. The lines are the
    plane's streams (its "XLA Ops" line only where it has no others)."""
    plane = first_gpu(data)
    if plane is None:
        return []
    lines = [ln for ln in plane.lines
             if ln.name not in (*SUMMARY_LINES, "XLA Ops")] or op_lines(plane)
    print("# first GPU's lines (events): "
          + ", ".join(f"{ln.name} ({len(list(ln.events))})" for ln in plane.lines))
    events = [(ln.name, e.name, e.start_ns, e.start_ns + e.duration_ns)
              for ln in lines for e in ln.events]
    if not events:
        return []
    t0 = min(e[2] for e in events)
    out = []
    for line, name, s, e in sorted(events, key=lambda x: x[2]):
        if not COLLECTIVE.search(name) or e <= s:
            continue
        others = [(n, max(s, s2), min(e, e2)) for l2, n, s2, e2 in events
                  if l2 != line and not COLLECTIVE.search(n) and s2 < e and e2 > s]
        union = _merge([(a, b) for _, a, b in others])
        by_op: dict[str, float] = collections.defaultdict(float)
        for n, a, b in others:
            by_op[n] += b - a
        top = sorted(by_op, key=lambda n: -by_op[n])[:3]
        out.append((name, line, s - t0, e - s, _covered(s, e, union), top))
    return out


def print_overlap(rows, steps: int) -> None:
    """The :func:`collective_overlap` table, per step."""
    if not rows:
        return
    total = sum(r[3] for r in rows) / steps / 1e6
    hidden = sum(r[4] for r in rows) / steps / 1e6
    print(f"\n# collectives on the first GPU: {total:.2f} ms per step, {hidden:.2f} ms of it "
          f"overlapped by compute on other streams ({hidden / max(total, 1e-9):.0%})")
    print("\n| collective | line | start ms | ms | overlapped | ops beside it |\n"
          "|---|---|---:|---:|---:|---|")
    for name, line, start, ns, cov, top in rows:
        print(f"| {name[:40]} | {line[:24]} | {start / 1e6:.2f} | {ns / 1e6:.3f} | "
              f"{cov / max(ns, 1):.0%} | {', '.join(t[:28] for t in top)} |")


def kind(name: str) -> str:
    """``scatter.12`` → ``scatter``; ``loop_fusion.3`` → ``loop_fusion``."""
    return re.sub(r"[._]\d+$", "", name.split(":")[0]).strip() or name


def fusion_text(hlo: str, op: str) -> str:
    """The instruction named like the profiler's ``op`` in ``hlo`` and, for a fusion, the
    computation it calls."""
    stem = re.escape(re.sub(r"[._](\d+)$", "", op))
    num = re.search(r"[._](\d+)$", op)
    pat = stem + (r"[._]" + num.group(1) if num else "")
    line = next((ln for ln in hlo.splitlines()
                 if re.match(rf"\s*(ROOT )?%?{pat} = ", ln)), None)
    if line is None:
        return f"(instruction {op} not found)"
    called = re.search(r"calls=%?([\w.\-]+)", line)
    if not called:
        return line.strip()
    body = re.search(rf"(?ms)^%?{re.escape(called.group(1))} .*?^}}", hlo)
    return line.strip() + "\n" + (body.group(0) if body else "")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="tiny model (CPU smoke check)")
    p.add_argument("--optimizer", default="dion3", choices=["dion3", "adamw"],
                   help="the step profiled: Dion3 (the options below) or optax.adamw(1e-3)")
    p.add_argument("--host", action="store_true",
                   help="trace without the Python tracer and list the host's events while the "
                        "GPU is idle before each step")
    p.add_argument("--queued", action="store_true",
                   help="trace the steps dispatched back to back, synchronized once (as a "
                        "training loop runs them): the GPU's idle time between ops is then the "
                        "time the host did not keep ahead of it")
    p.add_argument("--fraction", type=float, default=0.25)
    p.add_argument("--method", default="gram", choices=["gram", "standard"])
    p.add_argument("--backend", default="auto")
    p.add_argument("--pass-implementation", default="auto",
                   choices=["auto", "xla", "mosaic", "pallas_triton"],
                   help="the memory-bound passes' implementation")
    p.add_argument("--mu-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="the momentum's dtype (default: dion3's)")
    p.add_argument("--steps", type=int, default=3, help="traced steps")
    p.add_argument("--top", type=int, default=25, help="ops listed")
    p.add_argument("--show-hlo", nargs="+", default=[], metavar="KIND",
                   help="print the optimized HLO of the slowest op of each of these op kinds "
                        "(e.g. loop_gather_fusion)")
    p.add_argument("--dump-hlo", metavar="PATH",
                   help="write the profiled executable's whole optimized HLO text here "
                        "(gzip-compressed when PATH ends in .gz)")
    p.add_argument("--json", metavar="PATH",
                   help="write every op's milliseconds per step here (a JSON object)")
    p.add_argument("--fsdp", action="store_true",
                   help="bench_step.py's FSDP sharding over all devices (prints the collectives' "
                        "overlap with compute)")
    p.add_argument("--xla-option", action="append", default=[], metavar="NAME=VALUE",
                   help="compile the step with this XLA option (repeatable)")
    p.add_argument("--cpu-devices", type=int, default=None,
                   help="simulate this many CPU devices (CPU smoke runs)")
    p.add_argument("--old-dir", nargs="+", default=[], metavar="DIR",
                   help="first profile the Dion3 step of these versions (bench_commits.py "
                        "--export-to), each with its default options (and --mu-dtype)")
    a = p.parse_args(argv)
    if a.old_dir and (a.optimizer == "adamw" or a.json or a.dump_hlo):
        p.error("--old-dir profiles older versions of the Dion3 step beside it: not with "
                "--optimizer adamw, --json or --dump-hlo (which write one step's results)")
    olds = old_dirs(a.old_dir) if a.old_dir else {}
    if a.cpu_devices:
        jax.config.update("jax_num_cpu_devices", a.cpu_devices)
    cfg = _model.SMALL if a.small else _model.FULL
    shapes = _model.model_shapes(**cfg)
    params = _model.make_tree(shapes, 0)
    grads = _model.make_tree(shapes, 1, 1e-3)
    mesh = _model.fsdp_meshes(shapes)[0] if a.fsdp else None
    if mesh is not None:
        params, grads = _model.place(params, mesh), _model.place(grads, mesh)
    tx = (optax.adamw(1e-3) if a.optimizer == "adamw"
          else _model.dion3_step(a.fraction, a.method, a.backend,
                                 passes=a.pass_implementation, mu_dtype=a.mu_dtype))
    what = ("optax.adamw" if a.optimizer == "adamw"
            else f"dion3 f={a.fraction:g} {a.method} {a.backend} "
                 f"passes={a.pass_implementation} mu={a.mu_dtype or 'default'}")
    mu = {} if a.mu_dtype is None else {"mu_dtype": a.mu_dtype}
    versions = [(f"{name} = {commit}: dion3 f={a.fraction:g} (its defaults"
                 f"{'' if a.mu_dtype is None else ', mu=' + a.mu_dtype})",
                 imported(d, suffix).dion3(1e-3, a.fraction, **mu))
                for name, (d, suffix, commit) in olds.items()]
    versions.append((what, tx))
    for label, version_tx in versions:
        params, step, data = profile(version_tx, params, grads, mesh, a)
        report(data, step, a, f"{label}, {cfg['layers']} layers d={cfg['d']} ff={cfg['ff']}")


def profile(tx, params, grads, mesh, a):
    """Compiles ``tx``'s step, warms it up and traces ``a.steps`` steps: returns the updated
    parameters, the compiled step and the trace."""
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        state = tx.init(params)
        step, _ = _model.compile_step(tx, params, grads, mesh, state,
                                      _model.xla_options(a.xla_option))
        if a.dump_hlo:
            opener = gzip.open if a.dump_hlo.endswith(".gz") else open
            with opener(a.dump_hlo, "wt") as f:
                f.write(step.as_text())
        for _ in range(2):  # Warm-up.
            params, state = jax.block_until_ready(step(params, state, grads))
        trace_dir = tempfile.mkdtemp(prefix="dion3_profile_")
        options = jax.profiler.ProfileOptions()
        if a.host:  # Python's function events would swamp the host planes.
            options.python_tracer_level = 0
        with jax.profiler.trace(trace_dir, profiler_options=options):
            for _ in range(a.steps):
                params, state = step(params, state, grads)
                if not a.queued:
                    params, state = jax.block_until_ready((params, state))
            jax.block_until_ready((params, state))
    return params, step, load_trace(trace_dir)


def report(data: ProfileData, step, a, what: str) -> None:
    """Prints the tables of one traced step (``what`` names it)."""
    totals = op_times(data)
    per_step = {k: v / a.steps / 1e6 for k, v in totals.items()}
    total = sum(per_step.values())
    if a.json:
        with open(a.json, "w") as f:
            json.dump(per_step, f, indent=0, sort_keys=True)
    dev = jax.devices()[0]
    print(f"\n# {dev.device_kind}{' × %d, FSDP' % len(jax.devices()) if a.fsdp else ''}"
          f"{' ' + ' '.join(a.xla_option) if a.xla_option else ''}: {what}; device op time "
          f"per step {total:.2f} ms (summed over {len(per_step)} ops)")
    by_kind: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.Counter()
    for k, v in per_step.items():
        by_kind[kind(k)] += v
        counts[kind(k)] += 1
    print("\n| op kind | ops | ms / step | share |\n|---|---:|---:|---:|")
    for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])[:a.top]:
        print(f"| {k} | {counts[k]} | {v:.2f} | {v / total:.1%} |")
    gaps = device_gaps(data)
    if gaps:
        by_next: dict[str, float] = collections.defaultdict(float)
        for ns, name, _ in gaps:
            by_next[kind(name)] += ns / a.steps / 1e6
        idle = sum(by_next.values())
        print(f"\n# GPU idle between ops: {idle:.2f} ms per step in {len(gaps) // a.steps} gaps;"
              " by the kind of op that ends the gap:")
        print("\n| next op kind | idle ms / step |\n|---|---:|")
        for k, v in sorted(by_next.items(), key=lambda kv: -kv[1])[:12]:
            print(f"| {k} | {v:.2f} |")
        print("\n| longest gaps: after op | before op | µs |\n|---|---|---:|")
        for ns, name, before in sorted(gaps, key=lambda g: -g[0])[:12]:
            print(f"| {before[:50]} | {name[:50]} | {ns / 1e3:.1f} |")
    print_overlap(collective_overlap(data), a.steps)
    if a.host:
        print_host(data, a.top)
    print("\n| op | ms / step |\n|---|---:|")
    for k, v in sorted(per_step.items(), key=lambda kv: -kv[1])[:a.top]:
        print(f"| {k[:80]} | {v:.3f} |")
    if a.show_hlo:
        hlo = step.as_text()  # The executable that was profiled.
        for want in a.show_hlo:
            ops = [k for k in per_step if kind(k) == want]
            if not ops:
                print(f"\n# no op of kind {want}")
                continue
            op = max(ops, key=per_step.get)
            print(f"\n# HLO of {op} ({per_step[op]:.3f} ms / step)")
            print(fusion_text(hlo, op))


if __name__ == "__main__":
    main()
