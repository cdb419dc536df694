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
"""The whole default step lowers for TPU from the CPU (cross-platform lowering; nothing runs on
a TPU), with no GPU kernel in the module: on one device, and on an 8-device FSDP mesh whose
abstract devices are TPUs, where every ``"auto"`` kernel choice must resolve to ``"xla"``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, NamedSharding, PartitionSpec as P

import dion3_jax
import pallas_kernels
from pallas_kernels import _dispatch, _payload, _row_stats

SHAPES = {"q": (64, 64), "up": (64, 176), "down": (176, 64), "b": (64,)}
TPU = AbstractDevice(device_kind="TPU v5p", num_cores=1, platform="tpu")
H100 = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")


def _lowered_text(tx, params) -> str:
    state = jax.eval_shape(tx.init, params)
    return jax.jit(tx.update).trace(params, state, params).lower(
        lowering_platforms=("tpu",)).as_text()


def _assert_plain_xla(text: str) -> None:
    assert "dot_general" in text
    assert "triton" not in text and "mosaic_gpu" not in text


@pytest.mark.parametrize("fraction", [1.0, 0.25])
def test_the_step_lowers_for_tpu_on_one_device(fraction):
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
    _assert_plain_xla(_lowered_text(dion3_jax.dion3(0.02, fraction), params))


def _tpu_mesh(device=TPU) -> AbstractMesh:
    return AbstractMesh((8,), ("fsdp",), axis_types=(AxisType.Explicit,),
                        abstract_device=device)


def test_auto_resolves_to_xla_on_a_tpu_target():
    with jax.sharding.use_abstract_mesh(_tpu_mesh()):
        assert pallas_kernels.available_implementations() == ("xla",)
        assert pallas_kernels.accumulate_rows_implementation((4096, 4096), 2, "auto") == "xla"
        assert _payload.implementation_for((4096, 4096), "auto") == "xla"


def test_the_target_device_is_read_from_the_abstract_mesh():
    """The check above can fail: on a GPU abstract device "auto" takes a kernel."""
    with jax.sharding.use_abstract_mesh(_tpu_mesh(H100)):
        assert _dispatch.target_device().platform == "gpu"
        assert "pallas_triton" in pallas_kernels.available_implementations()
        assert pallas_kernels.accumulate_rows_implementation((4096, 4096), 2, "auto") != "xla"


@pytest.mark.parametrize("fraction", [1.0, 0.25])
def test_the_step_lowers_for_tpu_on_an_8_device_mesh(fraction):
    mesh = _tpu_mesh()
    specs = {"q": P("fsdp"), "up": P("fsdp"), "down": P("fsdp"), "b": P()}
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, specs[k]))
              for k, s in SHAPES.items()}
    with jax.sharding.use_abstract_mesh(mesh):
        text = _lowered_text(dion3_jax.dion3(0.02, fraction), params)
    _assert_plain_xla(text)
    assert "all_to_all" in text or "all-to-all" in text or fraction == 1.0
