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
"""Where the distributed tests run: ``DION3_TEST_PLATFORM`` (any ``jax.devices`` platform name,
e.g. ``gpu``; see scripts/gpu_multi.sh) or, unset, the default backend's devices.

``DION3_TEST_NUM_DEVICES=n`` (with a platform) keeps only that platform's first n devices, so a
machine of 2 GPUs can be rehearsed on the simulated CPU devices:
``DION3_TEST_PLATFORM=cpu DION3_TEST_NUM_DEVICES=2 pytest tests/test_distributed.py``."""

from __future__ import annotations

import contextlib
import os

import jax

PLATFORM = os.environ.get("DION3_TEST_PLATFORM") or None
DEVICES = jax.devices(PLATFORM) if PLATFORM else jax.devices()
if PLATFORM and os.environ.get("DION3_TEST_NUM_DEVICES"):
    _n = int(os.environ["DION3_TEST_NUM_DEVICES"])
    if not 1 <= _n <= len(DEVICES):
        raise ValueError(f"DION3_TEST_NUM_DEVICES={_n}: {PLATFORM} has {len(DEVICES)} devices")
    DEVICES = DEVICES[:_n]


@contextlib.contextmanager
def on_platform():
    """On a DION3_TEST_PLATFORM: float32 matmuls at full precision (no TF32), and single-device
    references on that platform's first device. Otherwise nothing changes."""
    if not PLATFORM:
        yield
        return
    with jax.default_matmul_precision("highest"), jax.default_device(DEVICES[0]):
        yield


def committed(tree):
    """``tree`` on the default device 0, committed, like params placed with ``jax.device_put``
    (a step compiles once either way: ``tests/test_compiles_once.py``)."""
    return jax.device_put(tree, jax.devices()[0])
