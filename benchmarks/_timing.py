"""Shared timing helper of the benchmark scripts."""

from __future__ import annotations

import statistics
import time

import jax


def median_ms(fn, *args, reps: int) -> float:
    """Median wall time in ms of ``fn(*args)``, synchronised with ``jax.block_until_ready``,
    after two warm-up calls (the first one compiles)."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
