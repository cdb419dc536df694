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


def rotated_sets(args, count: int) -> list[tuple]:
    """``count`` input sets for :func:`median_ms_rotated`: ``args`` and copies scaled by
    ``1 + s/64`` (other buffers, same structure and dtypes; a symmetric operand stays symmetric)."""
    return [tuple(args)] + [tuple((a * (1.0 + s / 64)).astype(a.dtype) for a in args)
                            for s in range(1, count)]


def median_ms_rotated(fn, arg_sets, *, reps: int) -> float:
    """Median device-bound time in ms of one ``fn(*args)``: every rep runs ``fn`` once on each of
    the ``len(arg_sets)`` input sets inside one jitted call and divides by their number.

    One dispatch and one synchronisation per rep are spread over several calls (a lone call of a
    0.2 ms kernel also measures ~0.05–0.1 ms of dispatch and host sync), and each call reads
    other buffers than the one before it, so no call finds its inputs in L2 (METHOD.md: rotate
    among input sets).
    """
    many = jax.jit(lambda sets: tuple(fn(*args) for args in sets))
    return median_ms(many, tuple(tuple(a) for a in arg_sets), reps=reps) / len(arg_sets)
