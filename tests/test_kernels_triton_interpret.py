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
"""The Triton kernel's logic on CPU through Triton's own interpreter (``TRITON_INTERPRET=1``).

jax-triton has no CPU path, so the ``@triton.jit`` kernel is launched directly on NumPy buffers in a
subprocess (the interpreter must be chosen before triton is imported). The interpreter expects torch
tensors; a small shim passes NumPy arrays instead. Skipped where the ``triton`` package is missing
(CI); run locally with e.g. ``pip install --target DIR triton==3.6.0`` and ``TRITON_SITE=DIR``
(any folder outside the environment).
"""

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

_SITE = os.environ.get("TRITON_SITE")
_HAS_TRITON = importlib.util.find_spec("triton") is not None or (
    _SITE is not None and os.path.isdir(os.path.join(_SITE, "triton")))

_SCRIPT = textwrap.dedent(r'''
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    if os.environ.get("TRITON_SITE"):
        sys.path.insert(0, os.environ["TRITON_SITE"])
    import numpy as np
    from triton.runtime import interpreter
    # Shim: NumPy buffers stand in for torch tensors (no host/device copies on CPU).
    interpreter.GridExecutor._init_args_hst = lambda self, a, k: (list(a), dict(k))
    interpreter.GridExecutor._restore_args_dev = lambda self, *a: None

    class Dtype:
        __module__ = "torch"
        def __init__(self, name): self.name = name
        def __str__(self): return "torch." + self.name

    class Buffer:
        def __init__(self, arr): self.arr, self.dtype = arr, Dtype(arr.dtype.name)
        def data_ptr(self): return self.arr.ctypes.data

    from pallas_kernels import _schedule, _triton
    kernel = _triton._kernel()

    def launch(a, b, c, n, k, batch, b_transposed, alpha, beta, tile=128, tile_k=64,
               a_transposed=False):
        t = n // tile
        num_lower = _schedule.num_lower_tiles(t)
        out = np.full((batch, n, n), np.nan, np.float16)  # Poisoned.
        fa = Buffer(a)
        kernel[(batch * num_lower,)](
            fa, Buffer(b), Buffer(c) if c is not None else fa, Buffer(out), N=n, K=k, T=t,
            NUM_LOWER=num_lower, BLOCK=tile, BLOCK_K=tile_k, A_TRANSPOSED=a_transposed,
            B_TRANSPOSED=b_transposed,
            HAS_C=c is not None, ALPHA=alpha, BETA=beta)
        return out.astype(np.float64)

    rng = np.random.default_rng(0)
    for n, batch, k in [(256, 1, 128), (384, 2, 192)]:
        x = rng.standard_normal((batch, n, k)).astype(np.float16)
        out = launch(x, x, None, n, k, batch, True, 1.0, 0.0)
        x64 = x.astype(np.float64)
        ref = x64 @ np.swapaxes(x64, -1, -2)
        assert not np.isnan(out).any() and (out == np.swapaxes(out, -1, -2)).all()
        assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-3
        xt = np.ascontiguousarray(np.swapaxes(x, -1, -2))  # (batch, k, n): syrk(transpose=True)
        out_t = launch(xt, xt, None, n, k, batch, False, 1.0, 0.0, a_transposed=True)
        assert not np.isnan(out_t).any() and (out_t == np.swapaxes(out_t, -1, -2)).all()
        assert np.linalg.norm(out_t - ref) / np.linalg.norm(ref) < 1e-3
        g = x64 @ np.swapaxes(x64, -1, -2)
        r = (g / np.linalg.norm(g, axis=(-2, -1), keepdims=True)).astype(np.float16)
        r64 = r.astype(np.float64)
        z = (-2.9 * r64 + 0.5 * r64 @ r64).astype(np.float16)
        out = launch(r, z, r, n, n, batch, False, 1.0, 3.9)
        ref = r64 @ z.astype(np.float64) + 3.9 * r64
        assert not np.isnan(out).any() and (out == np.swapaxes(out, -1, -2)).all()
        assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-3
    print("ok")
''')


@pytest.mark.skipif(not _HAS_TRITON, reason="needs the triton package (set TRITON_SITE)")
def test_triton_kernel_in_triton_interpreter():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
