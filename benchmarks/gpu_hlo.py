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
"""The optimizer step as XLA compiles it for an NVIDIA H200, on a machine with no GPU.

JAX's CUDA plugin compiles for a GPU that it is told about instead of one that it finds
(``jax.experimental.topologies.get_topology_desc`` with a target description, here
:data:`H200_TARGET`). The executable cannot run, but its optimized HLO is the program the GPU
would run, less two things: XLA's autotuning, which needs the device (each GEMM keeps XLA's
untuned choice), and the Mosaic GPU kernels' compile, which jaxlib does when an executable is
loaded. Install the plugin beside jax: ``pip install jax-cuda13-plugin==<jax's version>
jax-cuda13-pjrt==<jax's version>`` (NVIDIA's libraries are not needed to compile), and run with
``JAX_PLATFORMS=cpu``.

Per variant (AdamW, then Dion3 at each ``--fractions`` value) the table gives the compile
seconds and a census of the entry computation's top-level operations, the passes the GPU runs
one after another: how many there are and the bytes they read and write (each operation's
operands and results, in full, except for updates of part of an array, a ``scatter`` or
``dynamic-update-slice``, counted as done in place: their updates read and written, and of an
operand that a fusion only slices or gathers from, counted by what it reads). Rows that a
gather reads whole count at their own size, though the GPU reads whole 32-byte sectors, so the
bytes compare variants and find passes that a fusion could remove; they are not the step's
traffic. Below each variant's line come its ``--top`` largest groups (fusion kind and fused
computation, custom-call target, or op).

``--old-dir`` adds the Dion3 step of older versions, exported by ``bench_commits.py
--export-to``, compiled in the same process: a pass that a change removed shows in the old
version's census and not in the new one's.

Usage::

    JAX_PLATFORMS=cpu python benchmarks/gpu_hlo.py                      # 8 layers, 7B widths
    JAX_PLATFORMS=cpu python benchmarks/gpu_hlo.py --fractions 0.125 --top 12
    JAX_PLATFORMS=cpu python benchmarks/gpu_hlo.py --layers 2 --d 256 --ff 704   # small
    JAX_PLATFORMS=cpu python benchmarks/gpu_hlo.py --fractions 1 --old-dir DIR   # old and new
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import optax

try:
    import dion3_jax
except ImportError:  # running from a source checkout
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import dion3_jax
from bench_commits import imported, old_dirs
from _model import add_model_arguments, compile_step, model_shapes, shape_bytes_by_dtype

#: What XLA needs to know of an H200 to compile for it (an ``xla.GpuTargetConfigProto`` in text
#: form): 132 SMs of compute capability 9.0, 228 KiB of shared memory per SM (227 KiB for one
#: block), 141 GB of memory at 4.8 TB/s, 50 MiB of L2.
H200_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 150754820096
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  cuda_compute_capability { major: 9 minor: 0 }
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
device_description_str: "NVIDIA H200"
"""

#: Top-level operations that move no data of their own.
_FREE = frozenset(("parameter", "get-tuple-element", "bitcast", "tuple", "constant",
                   "optimization-barrier"))
#: Custom calls that only reserve memory.
_ALLOCATIONS = frozenset(("custom-call AllocateBuffer",))
#: Reads of part of an operand, counted by what they read.
_SLICES = frozenset(("slice", "dynamic-slice", "gather"))
#: Updates of part of an array (its first operand), counted as done in place.
_IN_PLACE = ("scatter", "dynamic_update_slice")
_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%(\S+) = (.*?) ([\w-]+)\((.*?)\)(.*)$")
_OPERAND = re.compile(r"%([^\s,)]+)")


def h200_mesh() -> Mesh:
    """A one-device mesh of a compile-only H200 (raises when JAX's CUDA plugin is missing)."""
    topology = topologies.get_topology_desc("h200", "cuda", target_config=H200_TARGET,
                                            topology="1x1x1")
    return Mesh(np.array(topology.devices), ("x",))


def compile_for_h200(tx: optax.GradientTransformation, shapes: dict, mesh: Mesh
                     ) -> tuple[str, float]:
    """``jit(update + apply_updates)`` of ``tx`` on float32 leaves of ``shapes``, compiled for
    the H200 of ``mesh``: its optimized HLO text and the seconds of trace, lowering and compile
    (the step is ``_model.compile_step``'s, as in ``bench_step.py``)."""
    on_mesh = NamedSharding(mesh, P())
    place = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_mesh)  # noqa: E731
    params = {k: place(jax.ShapeDtypeStruct(s, jnp.float32)) for k, s in shapes.items()}
    with jax.set_mesh(mesh):
        state = jax.tree.map(place, jax.eval_shape(tx.init, params))
    compiled, stages = compile_step(tx, params, params, mesh=mesh, state=state)
    return compiled.as_text(), stages.total


def _bytes(type_text: str) -> int:
    """Bytes of the arrays in an HLO type (``f16[8,512,512]{2,1,0}``, or a tuple of them)."""
    return sum(shape_bytes_by_dtype(type_text).values())


class Pass(NamedTuple):
    """One top-level operation of the entry computation."""

    group: str  # fusion kind and fused computation, custom-call target, or op
    result: str  # the result's HLO type
    nbytes: int  # its operands' and results' bytes


def _group(op: str, rest: str) -> str:
    if target := re.search(r'custom_call_target="([^"]+)"', rest):
        return f"custom-call {target.group(1)}"
    kind, calls = re.search(r"kind=(\w+)", rest), re.search(r"calls=%([A-Za-z_]+)", rest)
    if kind and calls:
        return f"{kind.group(1)} {calls.group(1).rstrip('_')}"
    return op


def _partial_reads(hlo: str) -> dict[str, dict[int, int]]:
    """Per fused computation, the parameters that it only slices (the array operand of a
    ``slice``, ``dynamic-slice`` or ``gather``): parameter number → bytes of the slices read."""
    out = {}
    for name, body in re.findall(r"^%(\S+) \(.*?\{\n(.*?)^\}", hlo, flags=re.M | re.S):
        params, users = {}, collections.defaultdict(list)
        for line in body.splitlines():
            if not (m := _INSTRUCTION.match(line)):
                continue
            inst, result, op, args, _ = m.groups()
            if op == "parameter":
                params[inst] = int(args)
            for j, operand in enumerate(_OPERAND.findall(args)):
                users[operand].append((op in _SLICES and j == 0, _bytes(result)))
        out[name] = {i: sum(b for _, b in users[p]) for p, i in params.items()
                     if users[p] and all(sliced for sliced, _ in users[p])}
    return out


def passes(hlo: str) -> list[Pass]:
    """The top-level operations of ``hlo``'s entry computation that read or write memory."""
    entry = hlo[hlo.index("\nENTRY"):]
    partial = _partial_reads(hlo[:hlo.index("\nENTRY")])
    sizes, out = {}, []
    for line in entry.splitlines():
        if not (m := _INSTRUCTION.match(line)):
            continue
        name, result, op, args, rest = m.groups()
        sizes[name] = _bytes(result)
        if op in _FREE:
            continue
        group = _group(op, rest)
        if group in _ALLOCATIONS:
            continue
        sliced = partial.get(c.group(1), {}) if (c := re.search(r"calls=%(\S+?),", rest)) else {}
        operands = [sliced.get(i, sizes.get(a, 0))
                    for i, a in enumerate(_OPERAND.findall(args))]
        if any(word in group for word in _IN_PLACE):  # reads and writes its updates only
            nbytes = 2 * sum(operands[1:])
        else:
            nbytes = sum(operands) + sizes[name]
        out.append(Pass(group, re.sub(r"\{[^}]*\}", "", result), nbytes))
    return out


def _census_lines(name: str, seconds: float, found: list[Pass], top: int) -> list[str]:
    groups = collections.defaultdict(lambda: [0, 0])
    for p in found:
        groups[p.group][0] += 1
        groups[p.group][1] += p.nbytes
    lines = [f"{name:<18} {seconds:8.2f} {len(found):6d} "
             f"{sum(p.nbytes for p in found) / 1e9:9.3f}"]
    for group, (count, nbytes) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"    {group:<44} {count:5d} {nbytes / 1e9:9.3f}")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(ap)
    ap.add_argument("--top", type=int, default=8, help="largest groups listed per variant")
    ap.add_argument("--old-dir", nargs="+", default=[], metavar="DIR",
                    help="also the Dion3 step of these versions (bench_commits.py --export-to), "
                         "each row named by the version (old, or its suffix)")
    ap.add_argument("--mu-dtypes", nargs="+", default=[], metavar="DTYPE",
                    choices=["float32", "bfloat16", "float16"],
                    help="also the working tree's Dion3 step with these momentum dtypes")
    a = ap.parse_args(argv)
    mesh = h200_mesh()
    shapes = model_shapes(a.layers, a.d, a.ff)
    olds = old_dirs(a.old_dir) if a.old_dir else {}
    versions = {name: imported(d, suffix) for name, (d, suffix, _) in olds.items()}
    versions["dion3"] = dion3_jax
    described = "".join(f"; {n} = {c}" for n, (_, _, c) in olds.items())
    print(f"compiled for an NVIDIA H200 (no device) on {os.cpu_count()} CPUs; {a.layers} "
          f"layers, d={a.d}, ff={a.ff}; jax {jax.__version__}{described}")
    print(f"{'step':<18} {'compile s':>8} {'passes':>6} {'GB moved':>9}")
    variants = [("optax.adamw", optax.adamw(1e-3))] + [
        (f"{name} f={f:g}", module.dion3(1e-3, f))
        for f in a.fractions for name, module in versions.items()] + [
        (f"dion3 f={f:g} {dt}", dion3_jax.dion3(1e-3, f, mu_dtype=jnp.dtype(dt)))
        for f in a.fractions for dt in a.mu_dtypes]
    for name, tx in variants:
        hlo, seconds = compile_for_h200(tx, shapes, mesh)
        print("\n".join(_census_lines(name, seconds, passes(hlo), a.top)), flush=True)


if __name__ == "__main__":
    main()
