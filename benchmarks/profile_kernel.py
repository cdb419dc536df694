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
"""Inside one Mosaic GPU kernel call: how long each warpgroup spends in the contraction's main
loop and in the epilogue of each work item, from Mosaic GPU's in-kernel profiler.

``pallas_kernels._mosaic`` names the two phases of a work item with ``jax.named_scope``
("mainloop": the pipelined ``wgmma`` steps; "epilogue": ``+ β·c``, rounding, the stores and
their mirrors). This script compiles the kernel with the profiler on (it wraps
``plgpu.CompilerParams`` while the kernel is traced: ``profile_space``, ``profile_dir``), runs it
once after warm-up calls of the same kernel without the profiler, and summarizes the trace that
Mosaic writes (one begin/end pair per scope, per warpgroup, per CTA). The profiler's buffer takes
shared memory, so the kernel runs with ``--stages`` pipeline stages (default 3; the 16-bit default
is 4, which leaves no room for the buffer).

Usage (a Hopper GPU)::

    python benchmarks/profile_kernel.py                       # sym_matmul 4096², K 4096, + β·c
    python benchmarks/profile_kernel.py --op syrk --k 16384   # syrk of 4096×16384
    python benchmarks/profile_kernel.py --sms 66              # half the SMs: is the L2 the limit?
    python benchmarks/profile_kernel.py --batch 32 --n 1024 --k 1024   # f = 1/4's Gram matrices
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import glob
import json
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from pallas_kernels import _mosaic  # noqa: E402


@contextlib.contextmanager
def profiled(profile_dir: str, space: int):
    """Mosaic GPU kernels traced inside this context record their named scopes."""
    plgpu = _mosaic.plgpu
    original = plgpu.CompilerParams
    plgpu.CompilerParams = functools.partial(original, profile_space=space,
                                             profile_dir=profile_dir)
    try:
        yield
    finally:
        plgpu.CompilerParams = original


def scope_spans(events: list[dict], warpgroups: int = 3) -> dict:
    """``{(scope, warpgroup): [µs, ...]}`` from a Mosaic trace's begin/end events (``tid`` is
    ``1 + warpgroup + warpgroups · CTA``)."""
    per_trace = collections.defaultdict(list)
    for e in events:
        per_trace[e["tid"]].append(e)
    spans = collections.defaultdict(list)
    for tid, trace in per_trace.items():
        stack = []
        for e in trace:
            if e["ph"] == "B":
                stack.append(e)
            else:
                begin = stack.pop()
                spans[(begin["name"], (tid - 1) % warpgroups)].append(e["ts"] - begin["ts"])
    return dict(spans)


def summary(events: list[dict]) -> list[str]:
    """Table lines: per scope and warpgroup, the count and the mean, p10 and p90 in µs; then the
    kernel's span."""
    lines = [f"{'scope':<10} {'warpgroup':>9} {'n':>5} {'mean µs':>8} {'p10':>8} {'p90':>8}"]
    for (name, wg), v in sorted(scope_spans(events).items()):
        v = np.asarray(v)
        lines.append(f"{name:<10} {wg:>9} {v.size:>5} {v.mean():8.2f} "
                     f"{np.percentile(v, 10):8.2f} {np.percentile(v, 90):8.2f}")
    ts = [e["ts"] for e in events]
    lines.append(f"kernel span (first to last event): {max(ts) - min(ts):.1f} µs")
    return lines


def operands(op: str, n: int, k: int, batch: int = 1):
    """Gram-NS-like float16 operands: for ``sym_matmul`` a symmetric ``(n, k)`` and ``(k, n)``
    pair (``k == n``: the same Gram matrix) and ``c``; for ``syrk`` an ``(n, k)`` matrix. With
    ``batch`` > 1, ``batch`` of each, stacked on a leading axis."""
    lead = (batch,) if batch > 1 else ()
    x = jax.random.normal(jax.random.key(0), (*lead, n, k), jnp.float32) / np.sqrt(k)
    if op == "syrk":
        return (x.astype(jnp.float16),)
    r = (x @ jnp.swapaxes(x, -1, -2)).astype(jnp.float16)
    b = r if k == n else jax.random.normal(jax.random.key(1), (*lead, k, n), jnp.float16)
    return (r if k == n else x.astype(jnp.float16)), b, r


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--op", choices=("sym_matmul", "syrk"), default="sym_matmul")
    p.add_argument("--n", type=int, default=4096, help="output side")
    p.add_argument("--k", type=int, default=4096, help="contraction length")
    p.add_argument("--batch", type=int, default=1, help="matrices per call (e.g. 32 for f = 1/4's "
                   "attention Gram matrices: --batch 32 --n 1024 --k 1024)")
    p.add_argument("--no-c", action="store_true", help="sym_matmul without the β·c addend")
    p.add_argument("--stages", type=int, default=None,
                   help="pipeline stages (default 3 for pairs, 2 for pingpong: the profiler's "
                        "buffer takes shared memory)")
    p.add_argument("--schedule", choices=("pairs", "pingpong"), default="pairs",
                   help="the kernel's work schedule (MosaicConfig.schedule)")
    p.add_argument("--space", type=int, default=64, help="profiler ranges per warpgroup")
    p.add_argument("--sms", type=int, default=None,
                   help="persistent CTAs (default: every SM); fewer CTAs share the L2 with fewer")
    a = p.parse_args(argv)
    if jax.devices()[0].platform != "gpu":
        sys.exit("profile_kernel.py needs a Hopper GPU (Mosaic GPU's profiler runs on device)")
    stages = a.stages or (3 if a.schedule == "pairs" else 2)
    config = _mosaic.MosaicConfig(max_concurrent_steps=stages, num_sms=a.sms,
                                  schedule=a.schedule)
    args = operands(a.op, a.n, a.k, a.batch)
    if a.op == "syrk":
        fn = functools.partial(_mosaic.syrk_mosaic, config=config)
    elif a.no_c:
        fn = lambda x, y, _: _mosaic.sym_matmul_mosaic(x, y, alpha=1.5, config=config)  # noqa
    else:
        fn = functools.partial(_mosaic.sym_matmul_mosaic, alpha=1.5, beta=-0.5, config=config)
    plain = jax.jit(fn).lower(*args).compile()
    for _ in range(20):  # Warm clocks first: Mosaic writes the trace of the first call only.
        jax.block_until_ready(plain(*args))
    with tempfile.TemporaryDirectory() as d:
        jax.clear_caches()
        with profiled(d, a.space):
            call = jax.jit(fn).lower(*args).compile()
        jax.block_until_ready(call(*args))
        (path,) = glob.glob(os.path.join(d, "*.json"))
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    c = "" if a.op == "syrk" or a.no_c else " + β·c"
    sms = a.sms or jax.devices()[0].core_count
    print(f"# {jax.devices()[0].device_kind}: {a.op} batch={a.batch} n={a.n} k={a.k}{c}, "
          f"{a.schedule} schedule, {stages} stages, "
          f"{config.tile}-tiles, {sms} CTAs, warpgroups 0-1 compute, 2 memory")
    print("\n".join(summary(events)))


if __name__ == "__main__":
    main()
