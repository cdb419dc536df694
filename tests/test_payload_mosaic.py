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
"""The payload pass's Mosaic GPU kernel for every row (``pallas_kernels._payload_mosaic``).

Through GPU interpret mode on the CPU against a float64 computation (fresh inputs; several
members, chunks and ring turns; non-finite values; the race detector); its lowering for an H200
at the benchmark's shapes, two kernels for any number of members; the block choice; which
implementation a call resolves to.
"""

import functools
import re

import jax
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, NamedSharding, use_abstract_mesh
from jax.sharding import PartitionSpec as P
import jax.numpy as jnp
import numpy as np
import pytest

import dion3_jax
from pallas_kernels import _payload, _payload_mosaic, stack_payloads
from pallas_kernels._payload_mosaic import MosaicPayloadConfig, stack_payloads_mosaic
from seeds import module_seed

#: Fresh random inputs per run, printed with every test (tests/seeds.py).
SEED = module_seed()

H200 = AbstractDevice("NVIDIA H200", 132, "gpu")
#: Small blocks: a 64 × 64 matrix has four column strips, two chunks and two steps per chunk.
_SMALL = MosaicPayloadConfig(rows=16, cols=16 * 4, chunk=32, stages=2)


def _members(rng, batches, shape, dtype=jnp.float32):
    sums = [jnp.asarray(rng.standard_normal((b, *shape), np.float32)).astype(dtype)
            for b in batches]
    denoms = jnp.asarray(rng.uniform(0.5, 3.0, sum(batches)).astype(np.float32))
    return sums, denoms


def _float64_payload(sums, denoms, out_dtype):
    """Each ``S / d`` in float64, rounded to float32 (a correctly rounded float32 division),
    then to ``out_dtype``."""
    s = np.concatenate([np.asarray(x, np.float64) for x in sums])
    d = np.asarray(denoms, np.float64)
    return np.asarray(jnp.asarray((s / d[:, None, None]).astype(np.float32)).astype(out_dtype))


@pytest.mark.parametrize("s_dtype,out_dtype", [(jnp.float32, jnp.float16),
                                               (jnp.bfloat16, jnp.bfloat16)])
def test_interpreted_kernel_matches_float64(s_dtype, out_dtype):
    """Every element within one rounding to ``out_dtype`` of the float64 quotient (the kernel
    divides in float32 and rounds once); NaN and ±inf pass through."""
    rng = np.random.default_rng(SEED)
    sums, denoms = _members(rng, (2, 1, 3), (64, 64), s_dtype)
    sums[1] = sums[1].at[0, 3, 5].set(jnp.nan).at[0, 7, 9].set(-jnp.inf)
    got = stack_payloads_mosaic(sums, denoms, out_dtype=out_dtype, config=_SMALL,
                                interpret=True)
    assert got.shape == (6, 64, 64) and got.dtype == out_dtype
    want = _float64_payload(sums, denoms, out_dtype).astype(np.float64)
    g = np.asarray(got, np.float64)
    np.testing.assert_array_equal(np.isnan(g), np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_allclose(g[ok], want[ok], rtol=float(jnp.finfo(out_dtype).eps), atol=0)


def test_the_op_runs_the_kernel_in_interpret_mode_and_agrees_with_xla():
    rng = np.random.default_rng(SEED)
    sums, denoms = _members(rng, (2, 2), (64, 128))
    got = stack_payloads(sums, denoms, out_dtype=jnp.float16, implementation="mosaic",
                         interpret=True)
    want = stack_payloads(sums, denoms, out_dtype=jnp.float16, implementation="xla")
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=2.0 ** -10, atol=0)


def test_interpreted_kernel_has_no_data_race():
    """Two members: the launch that creates the stack and the one that writes into it."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    sums, denoms = _members(np.random.default_rng(SEED), (2, 1), (64, 64))
    jax.block_until_ready(stack_payloads_mosaic(
        sums, denoms, out_dtype=jnp.float16, config=_SMALL,
        interpret=InterpretGPUParams(detect_races=True)))
    assert interpret_pallas_call.get_races().races_found is False


def test_blocks():
    assert _payload_mosaic.blocks((4096, 11008)) == (32, 128, 512)
    assert _payload_mosaic.blocks((11008, 4096)) == (32, 128, 256)
    assert _payload_mosaic.blocks((64, 64)) == (32, 64, 64)
    assert _payload_mosaic.blocks((64, 48)) is None     # 32 × 16 blocks: 512 < 1024 elements
    assert _payload_mosaic.blocks((64, 24)) is None     # 8 columns at most: < 16
    assert _payload_mosaic.blocks((8, 64)) is None      # 8 × 64 blocks: 512 elements


def test_lowers_for_h200_with_one_kernel_for_any_number_of_members():
    """Three members of the 7B step's MLP shapes lower for an H200 (no GPU needed) to one
    kernel whatever the member count, called for each member, that writes into an
    uninitialized stack in place (the custom call aliases it): nothing clears or copies it."""
    mesh = AbstractMesh((1,), ("x",), axis_types=(AxisType.Explicit,), abstract_device=H200)
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    fn = jax.jit(functools.partial(stack_payloads_mosaic, out_dtype=jnp.float16))
    for shape in ((4096, 11008), (11008, 4096)):
        with use_abstract_mesh(mesh):
            text = fn.trace([f32(8, *shape)] * 3, f32(24)).lower(
                lowering_platforms=("cuda",)).as_text()
        assert text.count("custom_call @mosaic_gpu") == 1
        assert len(re.findall(r"call @_write_member\(", text)) == 3
        assert text.count("output_operand_alias<output_tuple_indices = [], operand_index = 3") == 1
        assert text.count("custom_call @AllocateBuffer") == 1


def test_stack_is_typed_like_the_meshs_other_arrays():
    """Under an explicit mesh the stack has the type ``jnp.zeros`` would have: an array typed
    apart (an empty mesh) makes every jitted product that reads it lower a second kernel."""
    mesh = AbstractMesh((1,), ("x",), axis_types=(AxisType.Explicit,), abstract_device=H200)
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    fn = functools.partial(stack_payloads_mosaic, out_dtype=jnp.float16)
    with use_abstract_mesh(mesh):
        got = jax.eval_shape(fn, [f32(1, 64, 128)] * 2, f32(2))
        want = jax.eval_shape(lambda: jnp.zeros((2, 64, 128), jnp.float16))
    assert got.sharding == want.sharding
    assert not got.sharding.mesh.empty


@pytest.mark.slow  # the step on a mesh; the fast loop keeps the one-device lowerings above
def test_the_sharded_step_lowers_one_payload_kernel_per_group_for_h200s():
    """At f = 1 on an abstract mesh of eight H200s (FSDP-sharded leaves, so the payload pass
    runs inside the step's ``shard_map``), each shape group's payload pass lowers one kernel
    into one uninitialized stack."""
    mesh = AbstractMesh((8,), ("fsdp",), axis_types=(AxisType.Explicit,), abstract_device=H200)
    shapes = {"q": (1024, 1024), "up": (1024, 2816), "down": (2816, 1024)}
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
              for k, s in shapes.items()}
    with use_abstract_mesh(mesh):
        tx = dion3_jax.dion3(0.01, 1.0)
        state = jax.eval_shape(tx.init, params)
        text = jax.jit(tx.update).trace(params, state, params).lower(
            lowering_platforms=("cuda",)).as_text()
    assert len(set(re.findall(r"func.func private @(_write_member\w*)\(", text))) == 3
    assert text.count("custom_call @AllocateBuffer") == 3


def test_implementations_resolve():
    """The Mosaic kernel is taken by name for every row; with ``rows`` it raises; on Hopper
    ``"auto"`` takes it for every row, XLA for selected rows and for a shape it does not take,
    and never the Pallas-Triton kernel (only by name)."""
    mesh = AbstractMesh((1,), ("x",), axis_types=(AxisType.Explicit,), abstract_device=H200)
    with use_abstract_mesh(mesh):
        assert _payload.implementation_for((4096, 4096), "mosaic", every_row=True) == "mosaic"
        assert _payload.implementation_for((4096, 4096), "auto", every_row=True) == "mosaic"
        assert _payload.implementation_for((4096, 4096), "auto") == "xla"
        assert _payload.implementation_for((16, 32), "auto", every_row=True) == "xla"
        assert _payload.implementation_for((16, 32), "pallas_triton") == "pallas_triton"
        with pytest.raises(ValueError, match=r"'mosaic' needs every row \(no rows=\)"):
            _payload.implementation_for((4096, 4096), "mosaic")
    sums, denoms = _members(np.random.default_rng(SEED), (1, 1), (64, 64))
    sums[1] = sums[1].astype(jnp.bfloat16)
    with pytest.raises(ValueError, match="needs one dtype for all sums"):
        stack_payloads(sums, denoms, out_dtype=jnp.float16, implementation="mosaic",
                       interpret=True)
