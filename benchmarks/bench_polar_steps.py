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
"""Fewer polar steps at equal accuracy? Error against float64 and time of each polar variant.

Every variant (a coefficient list, its restarts and a ``preconditioning``) runs in one process
on the same inputs:

* Gaussian inputs of the benchmark shapes (seeded; the seed is printed): relative Frobenius
  error of the float16 result against the exact polar factor ``U Vᵀ`` computed in float64
  (``(X Xᵀ)^(-1/2) X`` by a float64 eigendecomposition), the range of its singular values, the
  median wall time of synchronized calls and the device time of a profiler trace;
* with ``--momenta N``: the momenta of the quality study's model (``examples/train_lm.py``,
  the study's size) after N AdamW steps (gradients' running sum with μ = 0.95), each 2-D block
  matrix whole (f = 1) and its quarter of columns with the largest l1 norms (an f = 1/4
  payload): the error of each variant against float64 (numpy SVD), its mean, its worst and the
  number of matrices where it is above the default's.

Usage::

    python benchmarks/bench_polar_steps.py                    # the benchmark shapes (GPU)
    python benchmarks/bench_polar_steps.py --momenta 60       # and the quality model's momenta
    python benchmarks/bench_polar_steps.py --small            # tiny shapes, a CPU smoke run
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import dion3_jax  # noqa: E402
from _timing import median_ms  # noqa: E402
from _trace import device_ms  # noqa: E402

#: name → polar options. The first is today's default.
VARIANTS = {
    "pe5": dict(coefficients="polar_express", restarts=(2,), preconditioning="none"),
    "pe5+bound": dict(coefficients="polar_express", restarts=(2,), preconditioning="norm_bound"),
    "pe5+aol": dict(coefficients="polar_express", restarts=(2,), preconditioning="aol"),
    "pe4": dict(coefficients="polar_express_4", restarts=(1,), preconditioning="none"),
    "pe4+bound": dict(coefficients="polar_express_4", restarts=(1,), preconditioning="norm_bound"),
    "pe4+aol": dict(coefficients="polar_express_4", restarts=(1,), preconditioning="aol"),
    "pe4+bound r-": dict(coefficients="polar_express_4", restarts=(),
                         preconditioning="norm_bound"),
}
FULL_SHAPES = [(4096, 16384), (8192, 28672), (32, 1024, 4096), (4096, 4096),
               (32, 4096, 1024), (16, 4096, 2816), (8, 11008, 1024),
               (32, 4096, 512), (16, 4096, 1408), (8, 11008, 512)]
SMALL_SHAPES = [(64, 256), (2, 96, 32), (64, 64)]


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split("x"))


def exact_polar(x: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """``U Vᵀ`` of each matrix of ``x`` (``(B, n, m)``) in float64, by the eigendecomposition
    of the short side's Gram matrix, and that Gram matrix's eigenvectors' basis (unused)."""
    with jax.enable_x64(True):
        y = jnp.asarray(x, jnp.float64)
        tall = y.shape[-2] > y.shape[-1]
        if tall:
            y = jnp.swapaxes(y, -1, -2)
        lam, v = jnp.linalg.eigh(jnp.einsum("bik,bjk->bij", y, y))
        inv = jnp.where(lam > 0, 1 / jnp.sqrt(jnp.where(lam > 0, lam, 1.0)), 0.0)
        p = jnp.einsum("bij,bj,bkj,bkm->bim", v, inv, v, y)
        return jnp.swapaxes(p, -1, -2) if tall else p


def error_and_spread(out: jax.Array, ref: jax.Array) -> tuple[float, float, float]:
    """Relative Frobenius error of ``out`` against ``ref`` and ``out``'s extreme singular
    values, in float64."""
    with jax.enable_x64(True):
        o = jnp.asarray(out, jnp.float64)
        r = jnp.asarray(ref, jnp.float64)
        err = float(jnp.linalg.norm(o - r) / jnp.linalg.norm(r))
        if o.shape[-2] > o.shape[-1]:
            o = jnp.swapaxes(o, -1, -2)
        sv = jnp.sqrt(jnp.clip(jnp.linalg.eigvalsh(jnp.einsum("bik,bjk->bij", o, o)), 0))
        return err, float(sv.min()), float(sv.max())


def _polar_fn(options: dict):
    return jax.jit(lambda y: dion3_jax.polar(y, out_dtype=jnp.float32, **options))


def shape_rows(shapes, variants, dtype, reps: int, seed: int) -> list[tuple]:
    """One row per shape and variant: (shape, variant, steps, error, σ min, σ max, ms,
    device ms)."""
    rows = []
    for i, shape in enumerate(shapes):
        x = np.random.default_rng(seed + i).standard_normal(shape).astype(np.float32)
        x = jnp.asarray(x, dtype)
        batch = x.reshape((-1, *shape[-2:]))
        ref = exact_polar(np.asarray(batch, np.float64))
        for name in variants:
            options = VARIANTS[name]
            fn = _polar_fn(options)
            err, lo, hi = error_and_spread(fn(batch), ref)
            ms = median_ms(fn, batch, reps=reps)
            dev = device_ms(fn, batch, reps=min(reps, 5))
            steps = len(dion3_jax.newton_schulz.get_coefficients(options["coefficients"]))
            rows.append((shape, name, steps, err, lo, hi, ms, dev))
            print(f"  {'x'.join(map(str, shape))} {name}: err {err:.3e}, {ms:.3f} ms",
                  flush=True)
        del ref
    return rows


#: Model sizes for ``--momenta``: the quality study's, one of its width for a CPU, a tiny one.
MODEL_SIZES = {
    "study": dict(d_model=512, layers=8, heads=8, seq_len=512, batch=32, data_mb=12.0,
                  compute_dtype="bfloat16"),
    "cpu": dict(d_model=512, layers=2, heads=8, seq_len=128, batch=8, data_mb=4.0),
    "tiny": dict(d_model=64, layers=2, heads=4, seq_len=64, batch=4, data_mb=1.0),
}


def quality_momenta(steps: int, size: str, seed: int) -> list[tuple[str, np.ndarray]]:
    """The quality study model's 2-D block matrices' momenta after ``steps`` AdamW steps
    (``M ← 0.95 M + G``), whole and as the quarter of columns with the largest l1 norms."""
    import optax
    from flax import nnx
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                    "examples"))
    import train_lm
    cfg = train_lm.Config(steps=steps, seed=seed, **MODEL_SIZES[size])
    data = train_lm.prepare_data(cfg)
    model = train_lm.ByteLM(cfg, nnx.Rngs(seed))
    opt = nnx.Optimizer(model, optax.adamw(3e-3, b1=0.8, b2=0.95), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, batch):
        grads = nnx.grad(train_lm.loss_fn)(model, batch)
        opt.update(model, grads)
        return grads

    mom = None
    for s in range(steps):
        batch = jnp.asarray(train_lm.windows(data["train"], data["train_starts"][s],
                                             cfg.seq_len))
        leaves = jax.tree_util.tree_leaves_with_path(nnx.state(step(model, opt, batch)))
        g = {jax.tree_util.keystr(p): v for p, v in leaves
             if v.ndim == 2 and "blocks" in jax.tree_util.keystr(p)}
        mom = g if mom is None else {k: 0.95 * mom[k] + g[k] for k in mom}
    out = []
    for k, m in mom.items():
        m = np.asarray(m, np.float32)
        cols = np.sort(np.argsort(-np.abs(m).sum(0))[:max(m.shape[1] // 4, 1)])
        out += [(f"{k} f=1", m), (f"{k} f=1/4", m[:, cols])]
    return out


def momenta_rows(mats, variants) -> list[tuple]:
    """Per variant: mean and worst error against float64 over ``mats``, and how many are above
    the first variant's error."""
    errs = {name: [] for name in variants}
    for _, m in mats:
        u, _, vt = np.linalg.svd(m.astype(np.float64), full_matrices=False)
        ref = u @ vt
        for name in variants:
            o = np.asarray(_polar_fn(VARIANTS[name])(jnp.asarray(m)), np.float64)
            errs[name].append(np.linalg.norm(o - ref) / np.linalg.norm(ref))
    base = np.asarray(errs[variants[0]])
    return [(name, float(np.mean(e)), float(np.max(e)),
             int(np.sum(np.asarray(e) > base * (1 + 1e-3))), float(np.mean(np.asarray(e) / base)))
            for name, e in errs.items()]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0, help="seed of the Gaussian inputs and model")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"],
                   help="input dtype (default float16, as bench_polar.py)")
    p.add_argument("--shapes", nargs="+", type=_shape, default=None, metavar="BxNxM")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--momenta", type=int, default=0, metavar="STEPS",
                   help="also the quality model's momenta after STEPS AdamW steps")
    p.add_argument("--model", default=None, choices=list(MODEL_SIZES),
                   help="the model of --momenta (default: study; tiny with --small)")
    args = p.parse_args(argv)
    shapes = args.shapes or (SMALL_SHAPES if args.small else FULL_SHAPES)
    dev = jax.devices()[0]
    print(f"# device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}, input "
          f"{args.dtype}, seed {args.seed}, median of {args.reps}")
    rows = shape_rows(shapes, args.variants, jnp.dtype(args.dtype), args.reps, args.seed)
    fmt = "| {} | {} | {} | {} | {} | {} | {} |"
    print(fmt.format("shape", "variant", "steps", "error vs float64", "singular values", "ms",
                     "device ms"))
    print(fmt.format(*["---"] * 7))
    for shape, name, steps, err, lo, hi, ms, dev_ms in rows:
        print(fmt.format("x".join(map(str, shape)), name, steps, f"{err:.3e}",
                         f"{lo:.3f}–{hi:.3f}", f"{ms:.3f}",
                         "-" if dev_ms is None else f"{dev_ms:.3f}"))
    if args.momenta:
        size = args.model or ("tiny" if args.small else "study")
        mats = quality_momenta(args.momenta, size, args.seed)
        print(f"\n{len(mats)} momenta of the {size!r} model after {args.momenta} steps; error "
              f"vs float64 (SVD)")
        print("| variant | mean error | worst error | above the default's | mean ratio |")
        print("|---|---|---|---|---|")
        for name, mean, worst, above, ratio in momenta_rows(mats, args.variants):
            print(f"| {name} | {mean:.3e} | {worst:.3e} | {above}/{len(mats)} | {ratio:.3f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
