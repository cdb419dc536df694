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
"""The collectives of the 7B-shapes Dion3 step compiled for eight H200s, on a machine with no GPU:
a 1-D ``fsdp = 8`` mesh against a 2-D ``(fsdp = 4, tp = 2)`` mesh.

The parameters are laid out by MaxText-like logical rules: ``embed → fsdp`` and ``heads, mlp →
tp``, so on the 1-D mesh q, k, v, gate and up are sharded along their input axis and o and down
along their output axis, and on the 2-D mesh every kernel is an FSDP × TP tile. Per mesh and
fraction the table gives, per collective kind, the instructions and the bytes of their operands
in the compiled program (XLA's GPU pipeline with JAX's CUDA plugin, as ``gpu_hlo.py`` compiles
for one H200; the step is ``jit(update + apply_updates)``, as ``bench_step.py`` builds it).

Usage::

    JAX_PLATFORMS=cpu python benchmarks/mesh_census.py                   # 8 layers, 7B widths
    JAX_PLATFORMS=cpu python benchmarks/mesh_census.py --layers 2 --d 256 --ff 704
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from _model import add_model_arguments, compile_step, dion3_jax, model_shapes
from bench_step import COLLECTIVES, collective_stats
from gpu_hlo import H200_TARGET

#: mesh name → (axis sizes, axis names).
MESHES = {"fsdp=8": ((8,), ("fsdp",)), "fsdp=4 x tp=2": ((4, 2), ("fsdp", "tp"))}


def h200_mesh(sizes, names) -> Mesh:
    """A mesh of compile-only H200s (raises when JAX's CUDA plugin is missing)."""
    n = int(np.prod(sizes))
    topology = topologies.get_topology_desc("h200", "cuda", target_config=H200_TARGET,
                                            topology=f"1x1x{n}")
    return Mesh(np.array(topology.devices[:n]).reshape(sizes), names,
                axis_types=(AxisType.Explicit,) * len(names))


def spec(name: str, tp: bool) -> P:
    """The leaf's spec under the rules ``embed → fsdp``, ``heads, mlp → tp`` (Flax (in, out)
    kernels: o and down take the model width as their output axis)."""
    inner = "tp" if tp else None
    if name.endswith(("/o", "/down")):
        return P(inner, "fsdp")
    return P("fsdp", inner)


def census(shapes: dict, mesh: Mesh, fraction: float) -> tuple[dict, float]:
    """Collective counts and bytes of the compiled step, and its compile seconds."""
    tp = "tp" in mesh.axis_names
    place = {k: jax.ShapeDtypeStruct(s, jnp.float32,
                                     sharding=NamedSharding(mesh, spec(k, tp)))
             for k, s in shapes.items()}
    tx = dion3_jax.dion3(0.01, fraction)
    with jax.set_mesh(mesh):
        state = jax.eval_shape(tx.init, place)
    compiled, stages = compile_step(tx, place, place, mesh=mesh, state=state)
    return collective_stats(compiled.as_text()), stages.total


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(ap)
    a = ap.parse_args(argv)
    shapes = model_shapes(a.layers, a.d, a.ff)
    kinds = list(COLLECTIVES)
    print(f"Dion3 step, {a.layers} layers (d = {a.d}, ff = {a.ff}), compiled for 8 H200s; per "
          "collective kind: instructions / MB of operands per device")
    print("| mesh | f | " + " | ".join(kinds) + " | compile s |")
    print("|---|---:|" + "---:|" * (len(kinds) + 1))
    for name, (sizes, names) in MESHES.items():
        mesh = h200_mesh(sizes, names)
        for f in a.fractions:
            stats, seconds = census(shapes, mesh, f)
            cells = [f"{stats[k][0]} / {stats[k][1] / 1e6:.1f}" for k in kinds]
            print(f"| {name} | {f:g} | " + " | ".join(cells) + f" | {seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()
