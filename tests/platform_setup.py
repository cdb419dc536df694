"""Where the distributed tests run: ``DION3_TEST_PLATFORM`` (any ``jax.devices`` platform name,
e.g. ``gpu``; see scripts/gpu_multi.sh) or, unset, the default backend's devices."""

from __future__ import annotations

import contextlib
import os

import jax

PLATFORM = os.environ.get("DION3_TEST_PLATFORM") or None
DEVICES = jax.devices(PLATFORM) if PLATFORM else jax.devices()


@contextlib.contextmanager
def on_platform():
    """On a DION3_TEST_PLATFORM: float32 matmuls at full precision (no TF32), and single-device
    references on that platform's first device. Otherwise nothing changes."""
    if not PLATFORM:
        yield
        return
    with jax.default_matmul_precision("highest"), jax.default_device(DEVICES[0]):
        yield
