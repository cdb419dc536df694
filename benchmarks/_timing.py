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
"""Shared timing helpers of the benchmark scripts.

- :func:`median_ms`: one call per synchronization (for calls of many milliseconds).
- :func:`median_ms_rotated`: several calls on different input sets per synchronization (for
  sub-millisecond kernels: spreads dispatch and host sync, keeps inputs out of L2).
- :func:`best_ms_rotated`: the same, the fastest call after as many untimed ones (for the
  ceilings of ``bench_floor.py``).
- :func:`median_ms_interleaved`: several variants timed in turn, one call each per round (for
  A/B comparisons: slow drifts of clocks or temperature reach every variant alike).
"""

from __future__ import annotations

import statistics
import time

import jax


def _timed_ms(fn, args, *, reps: int, warmup: int) -> list[float]:
    """Wall times in ms of ``reps`` calls ``fn(*args)``, each synchronized with
    ``jax.block_until_ready``, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def median_ms(fn, *args, reps: int) -> float:
    """Median wall time in ms of ``fn(*args)``, synchronized with ``jax.block_until_ready``,
    after two warm-up calls (the first one compiles)."""
    return statistics.median(_timed_ms(fn, args, reps=reps, warmup=2))


def rotated_sets(args, count: int) -> list[tuple]:
    """``count`` input sets for :func:`median_ms_rotated`: ``args`` and copies scaled by
    ``1 + s/64`` (other buffers, same structure and dtypes; a symmetric operand stays symmetric)."""
    return [tuple(args)] + [tuple((a * (1.0 + s / 64)).astype(a.dtype) for a in args)
                            for s in range(1, count)]


def median_ms_rotated(fn, arg_sets, *, reps: int) -> float:
    """Median device-bound time in ms of one ``fn(*args)``: every rep runs ``fn`` once on each of
    the ``len(arg_sets)`` input sets inside one jitted call and divides by their number.

    One dispatch and one synchronization per rep are spread over several calls (a lone call of a
    0.2 ms kernel also measures ~0.05–0.1 ms of dispatch and host sync), and each call reads
    other buffers than the one before it, so no call finds its inputs in L2.
    """
    sets = tuple(tuple(a) for a in arg_sets)
    return median_ms(_on_every_set(fn), sets, reps=reps) / len(sets)


def best_ms_rotated(fn, arg_sets, *, reps: int) -> float:
    """Fastest time in ms of one ``fn(*args)``: as :func:`median_ms_rotated`, but the minimum
    of ``reps`` timed calls after ``reps + 1`` untimed ones.

    For a ceiling (the best rate the device reaches): the untimed calls first bring an idle
    GPU's clocks up, where a median taken from a cold start reads low.
    """
    sets = tuple(tuple(a) for a in arg_sets)
    return min(_timed_ms(_on_every_set(fn), (sets,), reps=reps, warmup=reps + 1)) / len(sets)


def _on_every_set(fn):
    """One jitted call that runs ``fn`` on each of a tuple of input sets."""
    return jax.jit(lambda sets: tuple(fn(*args) for args in sets))


def median_ms_interleaved(calls: dict, *, reps: int, warmup: int = 2) -> dict:
    """Median wall time in ms of each of several calls, timed in interleaved rounds.

    Every round times each call once, synchronized with ``jax.block_until_ready``; the order of
    the calls rotates from round to round, so no variant always runs first or right after the
    same other one.

    Args:
      calls: name → a function of no arguments that runs one step and returns what to wait for
        (it may carry its own state, e.g. donated parameters, from call to call).
      reps: timed rounds.
      warmup: untimed rounds first (the first call of a jitted function compiles).

    Returns:
      name → median ms.
    """
    names = list(calls)
    for _ in range(warmup):
        for name in names:
            jax.block_until_ready(calls[name]())
    times = {name: [] for name in names}
    for r in range(reps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            jax.block_until_ready(calls[name]())
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}
