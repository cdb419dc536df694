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
"""Benchmark of the symmetric-product kernels (pallas_kernels) against XLA.

Prints one table: case, shape, dtype, implementation (and config), ms, speed-up over XLA, the
same two by device time (``dev ms``, ``dev xXLA``: the kernels' own time in a profiler trace,
without the host's dispatch and synchronization), TFLOP/s
counting only the useful half of the work (the ``n(n+1)/2`` distinct entries: ``n(n+1)·m`` FLOPs
for ``syrk`` of ``(n, m)``, ``n(n+1)·k`` for ``sym_matmul`` of ``(n, k)·(k, n)``), the relative
error against a float64 product, XLA's own error, and whether the output is exactly symmetric.

Times: ``jax.block_until_ready`` around each call, warm-up first, the median of ``--reps`` calls;
all variants in one run. Every table also gives each call's device time (``_trace.device_ms``:
the kernels' own time in a profiler trace of single calls), which leaves out the host's dispatch
and synchronization that a wall-clock time of a short call includes.

Usage (GPU machine; repository root on PYTHONPATH):
  python benchmarks/bench_kernels.py                # default shapes, every available backend
  python benchmarks/bench_kernels.py --variants     # also pipeline-depth variants of the kernels
  python benchmarks/bench_kernels.py --variants s3 w8s3   # only these variants
  python benchmarks/bench_kernels.py --polar        # also dion3_jax.polar per backend
  python benchmarks/bench_kernels.py --no-kernels --peers   # 4096³ GEMMs: cuBLAS, jax's Mosaic
                                                             # matmul, sym_matmul, per tile
  python benchmarks/bench_kernels.py --no-kernels --peers --peer-shapes 32x1024x1024 32x1024x4096
  python benchmarks/bench_kernels.py --shapes 8x1024x1024 2048x2048   # only these cases
  python benchmarks/bench_kernels.py --json out.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from pallas_kernels import _mosaic, _schedule, _triton
from _timing import median_ms, median_ms_rotated, rotated_sets
from _trace import device_ms

# (name, op, batch, n, m, dtype): syrk of (batch, n, m); sym_matmul of (batch, n, n)·(batch, n, n).
CASES = [
    ("syrk", "syrk", (), 4096, 16384, jnp.float16),
    ("syrk", "syrk", (), 4096, 16384, jnp.bfloat16),
    ("syrk", "syrk", (), 8192, 28672, jnp.float16),
    ("syrk", "syrk", (32,), 1024, 4096, jnp.float16),
    ("syrk", "syrk", (), 1024, 4096, jnp.float16),
    ("syrk", "syrk", (), 2048, 8192, jnp.float16),
    ("syrk", "syrk", (), 512, 2048, jnp.float16),
    ("sym_matmul", "sym", (), 4096, 4096, jnp.float16),
    ("sym_matmul", "sym", (), 8192, 8192, jnp.float16),
    ("sym_matmul", "sym", (8,), 4096, 4096, jnp.float16),  # batched, as in the optimizer step
    ("sym_matmul", "sym", (32,), 1024, 1024, jnp.float16),  # f = 1/4: q/k/v/o, 8 layers
    ("sym_matmul", "sym", (8,), 1024, 1024, jnp.float16),  # f = 1/4: the down projections
    ("sym_matmul", "sym", (4,), 1024, 1024, jnp.float16),
    ("sym_matmul", "sym", (), 2048, 2048, jnp.float16),
    ("sym_matmul", "sym", (32,), 512, 512, jnp.float16),  # f = 1/8: q/k/v/o
    ("sym_matmul", "sym", (), 1024, 1024, jnp.float16),
    # The rest of the 8-layer 7B-shapes step's Gram shapes (f = 1/4 and 1/8 payloads, padded).
    ("sym_matmul", "sym", (16,), 2816, 2816, jnp.float16),  # f = 1/4: gate/up
    ("sym_matmul", "sym", (16,), 1408, 1408, jnp.float16),  # f = 1/8: gate/up
    ("sym_matmul", "sym", (8,), 512, 512, jnp.float16),  # f = 1/8: the down projections
    ("syrk", "syrk", (16,), 2816, 4096, jnp.float16),
    ("syrk", "syrk", (8,), 1024, 11008, jnp.float16),
    ("syrk", "syrk", (16,), 1408, 4096, jnp.float16),
    ("syrk", "syrk", (32,), 512, 4096, jnp.float16),
    ("syrk", "syrk", (8,), 512, 11008, jnp.float16),
]

SMOKE_CASES = [  # Tiny shapes to check the script itself (e.g. on CPU).
    ("syrk", "syrk", (), 256, 512, jnp.float16),
    ("sym_matmul", "sym", (2,), 128, 128, jnp.bfloat16),
]

MOSAIC_VARIANTS = {  # Besides "default" (MosaicConfig.get_default(): 4 stages for 16-bit outputs).
    "s3": _mosaic.MosaicConfig(max_concurrent_steps=3),
    "pp3": _mosaic.MosaicConfig(schedule="pingpong", max_concurrent_steps=3),
}
#: Variants also run on every shape (the others only on the two headline shapes).
ALL_SHAPE_VARIANTS = ("mosaic[default]", "triton[default]")
TRITON_VARIANTS = {  # Besides "default" (TritonConfig(): 8 warps, 4 stages).
    "w8s3": _triton.TritonConfig(num_warps=8, num_stages=3),
    "w4s4": _triton.TritonConfig(num_warps=4, num_stages=4),
    "k32w8s5": _triton.TritonConfig(tile_k=32, num_warps=8, num_stages=5),
}


timed = median_ms



def _product_implementations() -> tuple[str, ...]:
    """The symmetric products' implementations that run here."""
    return tuple(b for b in pallas_kernels.available_implementations()
                 if b in ("xla", "mosaic", "jax_triton"))

def make_inputs(op, batch, n, m, dtype, key):
    """Operands and the float64 reference (computed on the device)."""
    with jax.enable_x64(True):
        mm = lambda u, v: jnp.matmul(u, v, precision="highest")
        if op == "syrk":
            x = jax.random.normal(key, (*batch, n, m), jnp.float32).astype(dtype)
            x64 = x.astype(jnp.float64)
            return (x,), {}, mm(x64, jnp.swapaxes(x64, -1, -2))
        # Gram-NS-like operands: R normalized Gram, Z = b·R + c·R² (commuting, symmetric).
        y = jax.random.normal(key, (*batch, n, 2 * n), jnp.float32)
        r = jnp.einsum("...ik,...jk->...ij", y, y) / (2.0 * n)
        r = (r / jnp.linalg.norm(r, axis=(-2, -1), keepdims=True)).astype(dtype)
        r64 = r.astype(jnp.float64)
        z = (-2.9 * r64 + 0.5 * mm(r64, r64)).astype(dtype)
        z64 = z.astype(jnp.float64)
        kw = dict(alpha=1.0, beta=3.9)
        return (r, z, r), kw, kw["alpha"] * mm(r64, z64) + kw["beta"] * r64


def rel_error(out, ref64) -> float:
    with jax.enable_x64(True):
        diff = out.astype(jnp.float64) - ref64
        return float(jnp.linalg.norm(diff) / jnp.linalg.norm(ref64))


def exactly_symmetric(out) -> bool:
    return bool(jnp.array_equal(out, jnp.swapaxes(out, -1, -2)))


def implementations(variants):
    """(label, syrk_fn, sym_fn) for every backend (and variant) that can run here.

    ``variants``: None (defaults only), an empty list (every variant) or the variant names to
    add (e.g. ``["s3"]``; unknown names raise ``ValueError``)."""
    known = {*MOSAIC_VARIANTS, *TRITON_VARIANTS}
    unknown = set(variants or ()) - known
    if unknown:
        raise ValueError(f"unknown variants {sorted(unknown)}; known: {sorted(known)}")
    impls = [("xla", lambda x: pallas_kernels.syrk(x, implementation="xla"),
              lambda a, b, c, **kw: pallas_kernels.sym_matmul(a, b, c, implementation="xla", **kw))]
    available = _product_implementations()
    families = [("mosaic", MOSAIC_VARIANTS, _mosaic.syrk_mosaic, _mosaic.sym_matmul_mosaic),
                ("jax_triton", TRITON_VARIANTS, _triton.syrk_triton, _triton.sym_matmul_triton)]
    for family, table, syrk_fn, sym_fn in families:
        if family not in available:
            continue
        chosen = {} if variants is None else {
            k: v for k, v in table.items() if not variants or k in variants}
        for name, cfg in {"default": None, **chosen}.items():
            impls.append((f"{family}[{name}]",
                          jax.jit(lambda x, cfg=cfg, f=syrk_fn: f(x, config=cfg)),
                          lambda a, b, c, cfg=cfg, f=sym_fn, **kw: f(a, b, c, config=cfg, **kw)))
    return impls


def bench_kernels(args, log):
    rows = []
    impls = implementations(args.variants)
    cases = SMOKE_CASES if args.smoke else CASES
    for ci, (name, op, batch, n, m, dtype) in enumerate(cases):
        if args.quick and ci > 0 and op == "syrk" and n > 4096:
            continue
        if args.shapes and "x".join(map(str, [*batch, n, m])) not in args.shapes:
            continue
        args_, kw, ref = make_inputs(op, batch, n, m, dtype, jax.random.key(ci))
        count = int(np.prod(batch)) if batch else 1
        useful_flops = count * n * (n + 1) * m
        xla_ms = xla_dev = None
        xla_err = None
        for label, syrk_fn, sym_fn in impls:
            # Variants only on the two headline shapes, unless named on the command line.
            named = bool(args.variants) and label.split("[")[-1].rstrip("]") in args.variants
            if "[" in label and label not in ALL_SHAPE_VARIANTS and not named and (
                    n, m, batch) not in ((4096, 16384, ()), (4096, 4096, ())):
                continue
            fn = syrk_fn if op == "syrk" else (lambda a, b, c, f=sym_fn: f(a, b, c, **kw))
            try:
                fn_j = jax.jit(fn)
                out = jax.block_until_ready(fn_j(*args_))
                err = rel_error(out, ref)
                sym = exactly_symmetric(out)
                finite = bool(jnp.isfinite(out).all())
                ms = median_ms_rotated(fn_j, rotated_sets(args_, args.rotate), reps=args.reps)
                dev = device_ms(fn_j, *args_, reps=min(args.reps, 5))
            except Exception as e:  # Report and go on: one failing variant must not hide others.
                log(f"FAILED {name} {batch}x{n}x{m} {jnp.dtype(dtype).name} {label}: "
                    f"{type(e).__name__}: {str(e)[:400]}")
                traceback.print_exc(file=sys.stderr)
                continue
            if label == "xla":
                xla_ms, xla_dev, xla_err = ms, dev, err
            row = dict(case=name, batch=list(batch), n=n, m=m, dtype=jnp.dtype(dtype).name,
                       impl=label, ms=ms, speedup=(xla_ms / ms) if xla_ms else None,
                       device_ms=dev, device_speedup=(xla_dev / dev) if xla_dev and dev else None,
                       tflops=useful_flops / ms / 1e9, rel_err=err,
                       err_vs_xla=(err / xla_err) if xla_err else None, symmetric=sym,
                       finite=finite)
            rows.append(row)
            log(format_row(row))
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")
        del args_, ref
    return rows


HEADER = (f"{'case':<11} {'shape':<18} {'dtype':<8} {'impl':<19} {'ms':>8} {'xXLA':>6} "
          f"{'dev ms':>8} {'dev xXLA':>8} {'TFLOP/s':>8} {'rel.err':>9} {'err/XLA':>7} {'sym':>4}")


def format_row(r):
    shape = "x".join(map(str, [*r["batch"], r["n"], r["m"]]))
    sp = f"{r['speedup']:.2f}" if r["speedup"] else "-"
    ex = f"{r['err_vs_xla']:.2f}" if r["err_vs_xla"] else "-"
    sym = "yes" if r["symmetric"] else "NO"
    if not r["finite"]:
        sym += " NaN!"
    dsp = f"{r['device_speedup']:.2f}" if r.get("device_speedup") else "-"
    return (f"{r['case']:<11} {shape:<18} {r['dtype']:<8} {r['impl']:<19} {r['ms']:8.3f} "
            f"{sp:>6} {_fmt(r.get('device_ms'), 8, 3)} {dsp:>8} {r['tflops']:8.1f} "
            f"{r['rel_err']:9.2e} {ex:>7} {sym:>4}")


def bench_polar(args, log):
    """``dion3_jax.polar(x, method="gram", backend=impl)`` per backend, if the polar takes one."""
    try:
        import inspect

        from dion3_jax import polar
        if "backend" not in inspect.signature(polar).parameters:
            log("polar: dion3_jax.polar has no `backend` parameter; skipped")
            return
    except Exception as e:  # The optimizer package may not be there yet.
        log(f"polar: dion3_jax.polar not importable ({type(e).__name__}: {e}); skipped")
        return
    shape = (128, 512) if args.smoke else (4096, 16384)
    x = jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(jnp.float16)
    runs = [("gram", "xla"), ("standard", "xla")] + [
        ("gram", b) for b in _product_implementations() if b != "xla"]
    ref = None
    title = "polar " + "x".join(map(str, shape)) + " fp16"
    log(f"{title:<24} {'method':<9} {'backend':<8} {'ms':>8} {'device ms':>9} "
        f"{'rel.diff vs gram/xla':>21}")
    for method, backend in runs:
        try:
            fn = jax.jit(lambda v, m=method, b=backend: polar(v, method=m, backend=b))
            out = jax.block_until_ready(fn(x)).astype(jnp.float32)
            ms = timed(fn, x, reps=args.reps)
            dev_ms = device_ms(fn, x, reps=min(args.reps, 5))
        except Exception as e:
            log(f"polar FAILED {method}/{backend}: {type(e).__name__}: {str(e)[:400]}")
            continue
        if method == "gram" and backend == "xla":
            ref = out
        diff = (float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
                if ref is not None else float("nan"))
        log(f"{'':<24} {method:<9} {backend:<8} {ms:8.3f} {_fmt(dev_ms, 9, 3)} {diff:21.2e}")
    polar_breakdown(args, log, x, polar)


def _jaxprs(jaxpr):
    """``jaxpr`` and every jaxpr nested in its equations (jit, custom derivatives, branches)."""
    yield jaxpr
    for eqn in jaxpr.eqns:
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                sub = getattr(sub, "jaxpr", sub)  # a closed jaxpr holds its jaxpr
                if hasattr(sub, "eqns"):
                    yield from _jaxprs(sub)


def _product_kind(eqn) -> str:
    """``"syrk"``, ``"sym_matmul"`` or ``"matmul"`` for one ``dot_general`` of the ``"xla"``
    products: ``syrk`` contracts an operand with itself along the same axis (``x·xᵀ``, ``xᵀ·x``),
    ``sym_matmul`` multiplies two square matrices, anything else is a plain matmul."""
    a, b = eqn.invars
    (contract_a, contract_b), _ = eqn.params["dimension_numbers"]
    if a is b and tuple(contract_a) == tuple(contract_b):
        return "syrk"
    square = lambda v: v.aval.shape[-1] == v.aval.shape[-2]  # noqa: E731
    return "sym_matmul" if square(a) and square(b) else "matmul"


def count_products(fn, *args) -> dict[str, int]:
    """How many ``syrk``, ``sym_matmul`` and plain matmuls ``fn(*args)`` traces to, read off its
    jaxpr (``fn`` must take the ``"xla"`` products, which trace to one ``dot_general`` each)."""
    counts = {"syrk": 0, "sym_matmul": 0, "matmul": 0}
    for jaxpr in _jaxprs(jax.make_jaxpr(fn)(*args).jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                counts[_product_kind(eqn)] += 1
    return counts


def _apply(q, x):
    """``Q·X`` as Gram Newton-Schulz applies it: a 16-bit result asked of the GEMM directly."""
    return jnp.einsum("...ik,...kj->...ij", q, x, preferred_element_type=q.dtype)


def polar_breakdown(args, log, x, polar):
    """Where Gram NS spends its time: each product of ``polar(x)`` counted and timed on its own."""
    counts = count_products(lambda v: polar(v, method="gram", backend="xla"), x)
    n = x.shape[0]
    g = jax.random.normal(jax.random.key(1), (n, n), jnp.float32) / n
    r = (g + g.T).astype(x.dtype)
    log(f"\npolar {'x'.join(map(str, x.shape))} Gram NS, per product: {counts}")
    log(f"{'backend':<8} {'syrk ms':>8} {'sym ms':>8} {'matmul ms':>9} {'sum ms':>8}")
    rot = lambda f, *a: median_ms_rotated(f, rotated_sets(a, args.rotate), reps=args.reps)
    for backend in _product_implementations():
        t_syrk = rot(lambda v, b=backend: pallas_kernels.syrk(v, implementation=b), x)
        t_sym = rot(lambda u, b=backend: pallas_kernels.sym_matmul(
            u, u, u, alpha=1.5, beta=-0.5, implementation=b), r)
        t_mm = rot(_apply, r, x)
        total = (counts["syrk"] * t_syrk + counts["sym_matmul"] * t_sym
                 + counts["matmul"] * t_mm)
        log(f"{backend:<8} {t_syrk:8.3f} {t_sym:8.3f} {t_mm:9.3f} {total:8.3f}")


def diagnose(args, log):
    """Locates non-symmetric or unwritten output tiles of each kernel's ``sym_matmul``/``syrk``.

    The output is computed right after a NaN-filled buffer of its size was freed; ``reused`` says
    whether it landed there (then NaN marks every element the kernel did not write).
    """
    from pallas_kernels import _api

    tile = 128
    for impl in [i for i in _product_implementations() if i != "xla"]:
        for n, batch, use_c in [(1024, (), True), (4096, (), True), (4096, (), False),
                                (1024, (4,), True)]:
            (r, z, c), kw, _ = make_inputs("sym", batch, n, n, jnp.float16, jax.random.key(n))
            c, kw = (c, kw) if use_c else (None, {})
            poison = jnp.full(r.shape, jnp.nan, jnp.float16).block_until_ready()
            address = poison.unsafe_buffer_pointer()
            poison.delete()
            out = jax.block_until_ready(_api.sym_matmul(r, z, c, implementation=impl, **kw))
            reused = out.unsafe_buffer_pointer() == address
            o = np.asarray(out.astype(jnp.float32)).reshape(-1, n, n)
            nan = np.isnan(o)
            asym = (o != np.swapaxes(o, -1, -2)) & ~nan
            bad = sorted({(int(b), int(i) // tile, int(j) // tile)
                          for b, i, j in zip(*np.nonzero(asym | nan))})
            log(f"diagnose {impl} sym_matmul n={n} batch={batch} c={use_c}: reused={reused} "
                f"nan={int(nan.sum())} asym={int(asym.sum())} bad (b, i, j) tiles={len(bad)} "
                f"{bad[:12]}")


def _peer_runs(batch: int, n: int, k: int):
    """(label, fn, operands, FLOPs, computed 128×128 tiles) for one peer shape: the full
    ``(batch, n, k)·(batch, k, n)`` GEMM in XLA (cuBLAS on a GPU); jax's Mosaic GPU matmul
    (``hopper_matmul_mgpu``: 128×128 tiles per warpgroup, 64-deep panels, 4 stages; unbatched
    shapes on Hopper only); and this package's kernel computing the lower tiles of the same
    product: ``sym_matmul`` of ``(n, n)·(n, n)`` where ``k == n``, else ``syrk`` of ``(n, k)``."""
    lead = (batch,) if batch > 1 else ()
    a = jax.random.normal(jax.random.key(0), (*lead, n, k), jnp.float16)
    b = jax.random.normal(jax.random.key(1), (*lead, k, n), jnp.float16)
    side = -(-n // 128)  # 128×128 tiles per side
    full_tiles = batch * side ** 2
    runs = [("XLA GEMM", lambda x, y: jnp.einsum("...ik,...kj->...ij", x, y,
                                                 preferred_element_type=jnp.float16),
             (a, b), 2 * batch * n * n * k, full_tiles)]
    if "mosaic" not in _product_implementations():
        return runs
    if not lead:
        from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
        cfg = hm.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4)
        runs.append(("jax hopper_matmul_mgpu", lambda x, y: hm.matmul(x, y, None, config=cfg),
                     (a, b), 2 * n * n * k, full_tiles))
    lower_tiles = batch * _schedule.num_lower_tiles(side)
    for label, cfg in (("", None), (" pp", MOSAIC_VARIANTS["pp3"])):
        kernel = ((f"sym_matmul (mosaic{label})",
                   lambda x, cfg=cfg: _mosaic.sym_matmul_mosaic(x, x, config=cfg)) if k == n
                  else (f"syrk (mosaic{label})",
                        lambda x, cfg=cfg: _mosaic.syrk_mosaic(x, config=cfg)))
        runs.append((*kernel, (a,), batch * n * (n + 1) * k, lower_tiles))
    return runs


def _peer_shape(text: str) -> tuple[int, int, int]:
    """``"BxNxK"`` or ``"NxK"`` → ``(B, N, K)``."""
    dims = [int(d) for d in text.split("x")]
    if len(dims) not in (2, 3):
        raise ValueError(f"--peer-shapes takes BxNxK or NxK, got {text!r}")
    return tuple(dims) if len(dims) == 3 else (1, *dims)


def bench_peers(args, log):
    """This package's symmetric products against full GEMMs of the same size, per shape of
    ``--peer-shapes`` (:func:`_peer_runs`). ``µs/tile`` is the time per computed 128×128
    output tile (the symmetric kernels compute the lower ones); TFLOP/s counts the full
    product's FLOPs for the GEMMs and the useful half for the symmetric kernels. Equal
    ``device µs/tile`` means the kernel computes a tile as fast as cuBLAS does at that shape."""
    shapes = [(2, 128, 128)] if args.smoke else [_peer_shape(s) for s in args.peer_shapes]
    log(f"\nproducts (B, n, k)·(B, k, n), float16, {args.rotate} rotated input sets per call, "
        f"median of {args.reps}; device: the kernels' own time in a trace of single calls")
    log(f"{'shape':<14} {'product':<24} {'ms':>8} {'TFLOP/s':>8} {'tiles':>6} {'µs/tile':>8} "
        f"{'device ms':>9} {'dev TFLOP/s':>11} {'device µs/tile':>14}")
    for batch, n, k in shapes:
        for name, fn, xs, flops, tiles in _peer_runs(batch, n, k):
            ms = median_ms_rotated(fn, rotated_sets(xs, args.rotate), reps=args.reps)
            dev_ms = device_ms(jax.jit(fn), *xs, reps=min(args.reps, 10))
            per_tile = None if dev_ms is None else dev_ms * 1e3 / tiles
            dev_rate = None if dev_ms is None else flops / dev_ms / 1e9
            log(f"{f'{batch}x{n}x{k}':<14} {name:<24} {ms:8.4f} {flops / ms / 1e9:8.0f} "
                f"{tiles:6d} {ms * 1e3 / tiles:8.4f} {_fmt(dev_ms, 9, 4)} "
                f"{_fmt(dev_rate, 11, 0)} {_fmt(per_tile, 14, 4)}")


def _fmt(value: float | None, width: int, digits: int) -> str:
    """``value`` right-aligned with ``digits`` decimals, or "-" (no GPU trace)."""
    return f"{'-':>{width}}" if value is None else f"{value:{width}.{digits}f}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="*", default=None, metavar="NAME",
                        help="also kernel tuning variants: all, or the ones named")
    parser.add_argument("--polar", action="store_true", help="also dion3_jax.polar per backend")
    parser.add_argument("--diagnose", action="store_true",
                        help="locate non-symmetric / unwritten tiles of the kernels' outputs")
    parser.add_argument("--no-kernels", action="store_true", help="skip the kernel table")
    parser.add_argument("--peers", action="store_true",
                        help="also sym_matmul against full GEMMs (XLA, jax's Mosaic matmul)")
    parser.add_argument("--peer-shapes", nargs="+", default=["4096x4096"], metavar="BxNxK",
                        help="--peers' products (B, n, k)·(B, k, n): sym_matmul where k == n, "
                             "else syrk (default: 4096x4096)")
    parser.add_argument("--quick", action="store_true", help="skip the largest syrk shapes")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (checks the script)")
    parser.add_argument("--shapes", nargs="+", default=None, metavar="BxNxM",
                        help="only the cases of these shapes, as the table prints them "
                             "(e.g. 8x1024x1024 4096x16384)")
    parser.add_argument("--warmup-s", type=float, default=2.0, help="seconds of GPU warm-up")
    parser.add_argument("--reps", type=int, default=20, help="timed calls per entry (median)")
    parser.add_argument("--rotate", type=int, default=8,
                        help="kernel calls per timed dispatch, each on its own input set")
    parser.add_argument("--json", default=None, help="append one JSON line per row to this file")
    args = parser.parse_args(argv)

    def log(line):
        print(line, flush=True)

    dev = jax.devices()[0]
    log(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}, "
        f"available: {_product_implementations()}")
    # Warm the GPU up (clocks ramp from idle) before anything is timed.
    w = jax.random.normal(jax.random.key(0), (8192, 8192), jnp.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < args.warmup_s:
        jax.block_until_ready(w @ w)
    del w
    if args.diagnose:
        diagnose(args, log)
    rows = []
    if not args.no_kernels:
        log(HEADER)
        rows = bench_kernels(args, log)
    if args.polar:
        bench_polar(args, log)
    if args.peers:
        bench_peers(args, log)
    if rows:
        log("\nsummary (best per case):")
        log(HEADER)
        seen = {}
        for r in rows:
            key = (r["case"], tuple(r["batch"]), r["n"], r["m"], r["dtype"])
            impl_family = r["impl"].split("[")[0]
            best = seen.get((key, impl_family))
            if best is None or r["ms"] < best["ms"]:
                seen[(key, impl_family)] = r
        for r in seen.values():
            log(format_row(r))


if __name__ == "__main__":
    main()
