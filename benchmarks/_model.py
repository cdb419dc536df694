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
"""The benchmarks' model and its optimizer step, shared by the scripts that time or inspect it.

The "7B-shapes" model (:data:`FULL`): 8 layers of Llama-7B matrices in Flax ``(in, out)``
layout, float32: per layer four 4096×4096 (q, k, v, o), two 4096→11008 (gate, up) and one
11008→4096 (down); 1.62 B matrix parameters. :data:`SMALL` is a tiny model of the same structure
for CPU smoke runs. The step is ``jit(update + apply_updates)`` with donated params and state
(:func:`jitted_step`); :func:`compile_step` traces, lowers and compiles it and times each stage
(:class:`ColdStart`). With FSDP every matrix is sharded along its output axis over a 1-D
``"fsdp"`` mesh of all devices (:func:`fsdp_meshes`, :func:`place`).

The timing loops themselves are in ``_timing.py`` (wall clock) and ``_trace.py`` (device time).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import numpy as np
import optax

try:
    import dion3_jax
except ImportError:  # running from a source checkout
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import dion3_jax

FULL = dict(layers=8, d=4096, ff=11008)
SMALL = dict(layers=2, d=64, ff=176)


def add_model_arguments(ap, fractions=(1.0, 0.25, 0.125)) -> None:
    """``--layers``, ``--d``, ``--ff`` (the 7B shapes by default) and ``--fractions``."""
    ap.add_argument("--layers", type=int, default=FULL["layers"])
    ap.add_argument("--d", type=int, default=FULL["d"], help="model width")
    ap.add_argument("--ff", type=int, default=FULL["ff"], help="MLP width")
    ap.add_argument("--fractions", type=float, nargs="+", default=list(fractions))


def model_shapes(layers: int, d: int, ff: int) -> dict[str, tuple[int, int]]:
    shapes = {}
    for i in range(layers):
        for name in ("q", "k", "v", "o"):
            shapes[f"l{i}/{name}"] = (d, d)
        shapes[f"l{i}/gate"] = (d, ff)
        shapes[f"l{i}/up"] = (d, ff)
        shapes[f"l{i}/down"] = (ff, d)
    return shapes


def make_tree(shapes, seed: int, scale: float = 1.0):
    key = jax.random.key(seed)
    out = {}
    for i, (name, s) in enumerate(sorted(shapes.items())):
        out[name] = scale * jax.random.normal(jax.random.fold_in(key, i), s, jnp.float32)
    return out


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
                "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}


def shape_bytes_by_dtype(text: str) -> dict[str, int]:
    """Bytes of the array shapes printed in ``text`` (HLO, e.g. ``f16[8,4096]``), per dtype."""
    out: dict[str, int] = {}
    for dt, dims in re.findall(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]", text):
        if dt in _DTYPE_BYTES:
            n = int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
            out[dt] = out.get(dt, 0) + _DTYPE_BYTES[dt] * n
    return out


#: The compute dtype of each Newton-Schulz method (``dion3_jax.polar``'s defaults); Dion3's own
#: orthogonalizer returns its polar factors in it, and so do the ones built here.
COMPUTE_DTYPE = {"gram": jnp.float16, "standard": jnp.bfloat16}


def orthogonalizer(method: str, backend: str):
    """``dion3_jax.make_orthogonalizer`` for one Newton-Schulz method and matmul backend."""
    return dion3_jax.make_orthogonalizer(method=method, backend=backend,
                                         out_dtype=COMPUTE_DTYPE[method])


def dion3_step(fraction: float, method: str, backend: str, per_leaf=None,
               passes: str = "auto", mu_dtype=None):
    """``dion3_jax.dion3`` with learning rate 0.01, megabatched or one Dion3 per parameter.

    Args:
      fraction: Dion3's ``f``.
      method: ``"gram"`` or ``"standard"`` Newton-Schulz.
      backend: ``pallas_kernels`` implementation of the symmetric products.
      per_leaf: ``None`` (megabatching: one Dion3 for the whole flat parameter dict), or the
        dict's keys: ``optax.partition`` then labels every parameter with its own key and gives
        each its own ``dion3``, so no two parameters share a shape group (one polar call and one
        collective pair per parameter instead of per shape group).
      passes: the memory-bound passes' ``pass_implementation``.
      mu_dtype: the momentum's dtype (None: ``dion3``'s default).

    Returns:
      The optax transformation.
    """
    def make():
        return dion3_jax.dion3(0.01, fraction, orthogonalizer=orthogonalizer(method, backend),
                               pass_implementation=passes, mu_dtype=mu_dtype)

    if per_leaf is None:
        return make()
    return optax.partition({k: make() for k in per_leaf}, {k: k for k in per_leaf})


def jitted_step(tx):
    """``jit(update + apply_updates)`` of ``tx``, ``(params, state, grads) → (params, state)``,
    with params and state donated."""
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(step, donate_argnums=(0, 1))


class ColdStart(NamedTuple):
    """Seconds of the three stages of a step's cold start: ``jax.jit(...).trace`` (Python),
    ``.lower`` (StableHLO) and ``.compile`` (XLA)."""

    trace: float
    lower: float
    compile: float

    @property
    def total(self) -> float:
        return self.trace + self.lower + self.compile


def compile_step(tx, params, grads, mesh=None, state=None, options=None):
    """``jit(update + apply_updates)`` (params and state donated), traced, lowered and compiled.

    ``state`` defaults to the abstract shapes of ``tx.init(params)`` (``jax.eval_shape``: no
    device memory), which is enough on one device; pass the real state under a mesh so that its
    shardings are the ones compiled for. ``options``: XLA compiler options for this executable
    alone (``Lowered.compile(compiler_options=...)``). Safe to call from several threads at once.

    Returns:
      ``(compiled, ColdStart)``: the executable and the wall time of each stage.
    """
    ctx = jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()
    with ctx:
        if state is None:
            state = jax.eval_shape(tx.init, params)
        t0 = time.perf_counter()
        traced = jitted_step(tx).trace(params, state, grads)
        t1 = time.perf_counter()
        lowered = traced.lower()
        t2 = time.perf_counter()
        compiled = lowered.compile(compiler_options=options or None)
        t3 = time.perf_counter()
    return compiled, ColdStart(t1 - t0, t2 - t1, t3 - t2)


def fsdp_meshes(shapes):
    """``(explicit, auto)``: 1-D ``"fsdp"`` meshes of all devices, Explicit and Auto axes.

    Raises:
      SystemExit: when a matrix's output rows do not divide among the devices.
    """
    devs = jax.devices()
    for name, (_, fan_out) in shapes.items():
        if fan_out % len(devs):
            raise SystemExit(f"--fsdp: {name} has {fan_out} output rows, not a multiple of "
                             f"{len(devs)} devices")
    return tuple(jax.make_mesh((len(devs),), ("fsdp",), axis_types=(kind,), devices=devs)
                 for kind in (AxisType.Explicit, AxisType.Auto))


def place(tree, mesh):
    """Every matrix sharded along its output axis (Flax layout) over ``mesh``."""
    return {k: jax.device_put(v, NamedSharding(mesh, P(None, "fsdp"))) for k, v in tree.items()}


def xla_options(pairs: list[str]) -> dict[str, bool | int | str]:
    """``["name=value", ...]`` → ``{name: value}``; ``true``/``false`` and integers are
    converted (XLA checks each option's type).

    Raises:
      SystemExit: on an item without ``=``.
    """
    out = {}
    for item in pairs:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"--xla-option {item!r}: expected NAME=VALUE")
        low = value.lower()
        out[name] = (low == "true" if low in ("true", "false")
                     else int(value) if value.lstrip("-").isdigit() else value)
    return out
