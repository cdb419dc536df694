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
"""The step as XLA compiles it for an H200, checked on a machine with no GPU
(``benchmarks/gpu_hlo.py``): no pass copies a momentum-sized array.

At f = 1 every row of the momentum is selected and decayed; the statistics pass writes
``S = d ⊙ M + G`` into the momentum's donated buffer and the parameter pass updates the
parameters in place, so the GPU program holds no top-level ``copy`` of a matrix-sized array
(the GPU profiles of docs/BENCHMARKS.md showed the same). The compile needs JAX's CUDA plugin
(``bash scripts/setup_env.sh cuda-compile``) and skips without it, unless
``DION3_REQUIRE_CUDA_COMPILE=1`` (``.ci/run`` sets it, so that its run cannot pass by skipping).
"""

from __future__ import annotations

import os
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import dion3_jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_commits  # noqa: E402
import gpu_hlo  # noqa: E402

pytestmark = [pytest.mark.tooling, pytest.mark.usefixtures("default_xla_optimizations")]

#: A small model of the 7B shapes' aspect ratios: per layer four d×d matrices, two d→ff, one
#: ff→d, float32.
SHAPES = gpu_hlo.model_shapes(2, 256, 704)


@pytest.fixture(scope="module")
def mesh():
    try:
        return gpu_hlo.h200_mesh()
    except Exception as e:  # no CUDA plugin: no GPU compiler to ask
        if os.environ.get("DION3_REQUIRE_CUDA_COMPILE") == "1":
            raise
        pytest.skip(f"JAX's CUDA plugin cannot compile for an H200 here: {e!r}"[:300])


def _matrix_sized_copies(found: list[gpu_hlo.Pass]) -> list[gpu_hlo.Pass]:
    """The copies that read and write at least the smallest matrix leaf."""
    smallest = min(a * b for a, b in SHAPES.values()) * 4
    return [p for p in found if p.group == "copy" and p.nbytes >= 2 * smallest]


def test_census_sees_a_copy(mesh):
    """The census finds the copy XLA must make to keep an input alive beside its updated
    version (the pattern the step avoids)."""
    x = jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=NamedSharding(mesh, P()))
    with jax.set_mesh(mesh):
        hlo = jax.jit(lambda m: (m, m.at[0].set(1.0))).trace(x).lower().compile().as_text()
    assert [p.result for p in gpu_hlo.passes(hlo) if p.group == "copy"], hlo


def test_census_counts_adamw_s_bytes(mesh):
    """AdamW's step reads ``W, G, m, v`` and writes ``W, m, v``: 28 bytes per float32 parameter
    (and a few scalars), every operand of its fused updates counted once."""
    hlo, _ = gpu_hlo.compile_for_h200(optax.adamw(1e-3), SHAPES, mesh)
    params = sum(a * b for a, b in SHAPES.values())
    assert 0 <= sum(p.nbytes for p in gpu_hlo.passes(hlo)) - 28 * params < 1024


@pytest.mark.parametrize("fraction", [1.0, 0.25])
def test_no_pass_copies_a_matrix(mesh, fraction):
    hlo, _ = gpu_hlo.compile_for_h200(dion3_jax.dion3(1e-3, fraction), SHAPES, mesh)
    found = gpu_hlo.passes(hlo)
    assert sum(p.group == "custom-call mosaic_gpu_v2" for p in found) > 0  # the GPU's kernels
    copies = _matrix_sized_copies(found)
    assert not copies, copies


def test_statistics_row_sums_are_finished_per_shape_group(mesh):
    """The statistics kernel returns per-chunk partial row sums, and the step adds up each
    shape group's in one reduction: no pass finishes one matrix's sums on its own (a loop
    reduction to a single row vector; two per matrix before). One layer of the 7B shapes, whose
    summed axes are long enough for several chunks (at the small SHAPES the chunks are too few
    for XLA to keep any reduction on its own)."""
    shapes = gpu_hlo.model_shapes(1, 4096, 11008)
    hlo, _ = gpu_hlo.compile_for_h200(dion3_jax.dion3(1e-3, 0.25), shapes, mesh)
    assert "accumulate_rows" in hlo, "no statistics kernel"
    found = gpu_hlo.passes(hlo)
    own = [p for p in found if p.group == "kLoop fused_reduce"
           and re.fullmatch(r"f32\[\d+\]", p.result)]
    assert not own, own


@pytest.fixture(scope="module")
def float16_step(mesh) -> str:
    """The 8-layer step (56 leaves, width 256) with a float16 momentum, compiled for an H200
    once for the tests below."""
    hlo, _ = gpu_hlo.compile_for_h200(dion3_jax.dion3(1e-3, 0.25, mu_dtype=jnp.float16),
                                      gpu_hlo.model_shapes(8, 256, 704), mesh)
    return hlo


def test_a_16bit_step_launches_no_kernel_per_leafs_key(float16_step):
    """A float16 momentum's statistics kernels read their leaf's rounding key from the step's
    table of keys: no pass of the compiled step slices one leaf's key out of it (a small
    kernel per leaf and write before)."""
    assert "accumulate_rows" in float16_step, "no statistics kernel"
    found = gpu_hlo.passes(float16_step)
    keys = [p for p in found if re.fullmatch(r"u32\[(1,)?2\]|s32\[1\]", p.result)]
    assert not keys, keys


def test_a_16bit_step_writes_its_leaves_bounds_without_a_pass_each(float16_step):
    """The float16 momenta's storage bounds (a scalar per leaf in the state) leave the step
    without a one-element pass per leaf (56 slices of one table before)."""
    one = [p for p in gpu_hlo.passes(float16_step) if p.result == "f32[1]"]
    assert not one, one


def test_script_prints_a_census_per_variant(mesh, capsys):
    gpu_hlo.main(["--layers", "1", "--d", "128", "--ff", "352", "--fractions", "0.25",
                  "--top", "2"])
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith(("optax", "dion3"))]
    assert [r[0] for r in rows] == ["optax.adamw", "dion3"], out
    assert all(float(r[-3]) > 0 and int(r[-2]) > 0 and float(r[-1]) > 0 for r in rows), out


def test_script_censuses_an_exported_version_in_the_same_process(mesh, tmp_path, capsys,
                                                                  monkeypatch):
    """``--old-dir``: HEAD's packages, exported by ``bench_commits.py`` under the suffix ``_h``,
    compile beside the working tree's, each in its own row, from its own files."""
    bench_commits.export_dir("HEAD", tmp_path / "h", "_h")
    monkeypatch.setattr(sys, "path", list(sys.path))  # main() puts the export on the path
    gpu_hlo.main(["--layers", "1", "--d", "128", "--ff", "352", "--fractions", "1",
                  "--top", "1", "--old-dir", str(tmp_path / "h")])
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith(("optax", "old", "dion3"))]
    assert [r[0] for r in rows] == ["optax.adamw", "old", "dion3"], out
    assert all(int(r[-2]) > 0 and float(r[-1]) > 0 for r in rows), out
    assert "; old = " in out.splitlines()[0], out
    assert sys.modules["dion3_jax_h"].__file__.startswith(str(tmp_path)), out


def test_tiled_mesh_moves_the_same_payloads_in_as_many_all_to_alls():
    """``benchmarks/mesh_census.py`` on a small model compiled for eight H200s: the FSDP × TP
    tiles of a (4, 2) mesh take the 1-D FSDP mesh's all-to-alls (one pair per shape group: q/k/v,
    o, gate/up, down) and move as many payload bytes, give or take the rounding up of each row
    shard's ``ceil(f · rows)``; no all-gather either way (local scope)."""
    try:
        import mesh_census
        meshes = {name: mesh_census.h200_mesh(*m) for name, m in mesh_census.MESHES.items()}
    except Exception as e:  # no CUDA plugin: no GPU compiler to ask
        if os.environ.get("DION3_REQUIRE_CUDA_COMPILE") == "1":
            raise
        pytest.skip(f"JAX's CUDA plugin cannot compile for eight H200s here: {e!r}"[:300])
    shapes = mesh_census.model_shapes(2, 64, 176)
    stats = {name: mesh_census.census(shapes, m, 0.25)[0] for name, m in meshes.items()}
    one_d, tiles = stats["fsdp=8"], stats["fsdp=4 x tp=2"]
    assert one_d["all-to-all"][0] == tiles["all-to-all"][0] == 2 * 4, stats
    assert 0.9 <= tiles["all-to-all"][1] / one_d["all-to-all"][1] <= 1.1, stats
    assert one_d["all-gather"][0] == tiles["all-gather"][0] == 0, stats
