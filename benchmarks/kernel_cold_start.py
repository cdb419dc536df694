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
"""Cold-start cost of each symmetric-product kernel of the 7B-shapes step, one at a time.

For each kernel shape of the step at f = 1 and f = 1/4 (the ``syrk`` of each shape group's
Gram matrix and the ``sym_matmul`` of its iteration), wraps the Mosaic GPU kernel alone in a
``jax.jit`` and prints the seconds to lower and to compile it, the first call's seconds and the
median of ``--reps`` synchronized calls (ms). Every shape runs ``--rounds`` times in a row (the
first round also pays the process's first lowering and compile); the docs quote the last.

``--compare FILE`` also imports another copy of ``pallas_kernels/_mosaic.py`` (for example one
with another ``lowering_semantics``), runs each shape through both in alternation, and says
whether the two outputs are bitwise equal.

Needs a Hopper GPU. Usage (repository root)::

    python benchmarks/kernel_cold_start.py
    python benchmarks/kernel_cold_start.py --compare path/to/_mosaic_copy.py --rounds 2
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from pallas_kernels import _mosaic  # noqa: E402
from _timing import median_ms  # noqa: E402

#: (product, operand shape, transposed): the f = 1 kernels, then f = 1/4's that differ.
CASES = (("syrk", (8, 11008, 4096), True), ("syrk", (16, 4096, 11008), False),
         ("syrk", (32, 4096, 4096), False), ("sym_matmul", (8, 4096, 4096), False),
         ("sym_matmul", (16, 2816, 2816), False), ("syrk", (32, 4096, 1024), True),
         ("sym_matmul", (32, 1024, 1024), False))


def kernel_fn(module, product: str, transpose: bool):
    """The kernel of ``module`` (a copy of ``pallas_kernels._mosaic``) in its own ``jax.jit``."""
    if product == "syrk":
        return jax.jit(lambda x: module.syrk_mosaic(x, transpose=transpose))
    return jax.jit(lambda a, b, c, s: module.sym_matmul_mosaic(a, b, c, alpha=s[0], beta=s[1]))


def operands(product: str, shape: tuple[int, ...], key) -> tuple:
    """float16 operands of ``product``: a batch for ``syrk``; for ``sym_matmul`` a symmetric
    batch (each operand and the addend) and the scales."""
    if product == "syrk":
        return (jax.random.normal(key, shape, jnp.float16) * 0.05,)
    x = jax.random.normal(key, shape, jnp.float16) * 0.05
    a = (x @ jnp.swapaxes(x, -1, -2)) / shape[-1]
    return a, a, a, jnp.array([1.5, -0.5], jnp.float32)


def cold_start(fn, args, reps: int) -> tuple[float, float, float, float, np.ndarray]:
    """``(lower s, compile s, first call s, median ms, output)`` of a fresh ``jax.jit``."""
    t0 = time.perf_counter()
    lowered = fn.lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    out = compiled(*args).block_until_ready()
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2, median_ms(compiled, *args, reps=reps), np.asarray(out)


def _load(path: str):
    spec = importlib.util.spec_from_file_location("_mosaic_compared", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclass looks its module up while being made)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="runs of each shape (default 2)")
    p.add_argument("--reps", type=int, default=20, help="timed calls per kernel (default 20)")
    p.add_argument("--compare", default=None, metavar="FILE",
                   help="another copy of pallas_kernels/_mosaic.py, run in alternation")
    a = p.parse_args(argv)
    modules = {"tree": _mosaic} | ({"compared": _load(a.compare)} if a.compare else {})
    dev = jax.devices()[0]
    print(f"# {dev.device_kind}; jax {jax.__version__}; seconds, ms: median of {a.reps}")
    print("| kernel | shape | version | round | lower s | compile s | first s | ms | equal |")
    print("|---|---|---|---:|---:|---:|---:|---:|---|")
    for product, shape, transpose in CASES:
        args = operands(product, shape, jax.random.key(0))
        for r in range(a.rounds):
            outs = {}
            for name, module in modules.items():
                low, comp, first, ms, outs[name] = cold_start(
                    kernel_fn(module, product, transpose), args, a.reps)
                equal = ("-" if len(outs) < 2 else
                         str(np.array_equal(outs["tree"], outs["compared"])))
                label = product + (" (transposed)" if transpose else "")
                print(f"| {label} | {'×'.join(map(str, shape))} | {name} | {r + 1} | {low:.3f} "
                      f"| {comp:.3f} | {first:.3f} | {ms:.3f} | {equal} |", flush=True)


if __name__ == "__main__":
    main()
