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
"""Device time from a ``jax.profiler`` trace, shared by the benchmark scripts.

Wall-clock timing of a sub-millisecond kernel also measures the host: the dispatch of the jitted
call and the synchronization. Spreading them over several calls (``_timing.median_ms_rotated``)
shrinks that share but does not remove it, and it weighs more on a short kernel than on a long
one. A trace gives what the GPU itself spent: :func:`device_ms` sums the durations of the device
ops that one call ran.

- :func:`load_trace`, :func:`first_gpu`, :func:`op_lines`: reading a trace (also used by
  ``profile_step.py``).
- :func:`busy_ns`: the summed op time of a GPU plane.
- :func:`device_ms`: a function's device time per call, traced.
"""

from __future__ import annotations

import glob
import os
import tempfile

import jax
from jax.profiler import ProfileData

#: Lines of a GPU plane that summarize rather than hold device ops.
SUMMARY_LINES = ("XLA Modules", "Steps")


def load_trace(trace_dir: str) -> ProfileData:
    """The ``jax.profiler`` trace written under ``trace_dir``."""
    (path,) = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    return ProfileData.from_file(path)


def first_gpu(data: ProfileData):
    """The plane of the first GPU (all devices run the same program), or None on CPU."""
    planes = sorted((p for p in data.planes if p.name.startswith("/device:GPU")),
                    key=lambda p: p.name)
    return planes[0] if planes else None


def op_lines(plane):
    """The lines of a GPU plane that hold the device ops: "XLA Ops" where the trace has it,
    else every line but the module and step summaries."""
    return [ln for ln in plane.lines if ln.name == "XLA Ops"] or [
        ln for ln in plane.lines if ln.name not in SUMMARY_LINES]


def busy_ns(plane) -> float:
    """Total duration of the device ops of ``plane`` (its :func:`op_lines`), nanoseconds."""
    return float(sum(e.duration_ns for line in op_lines(plane) for e in line.events))


def device_ms(fn, *args, reps: int) -> float | None:
    """Milliseconds of device ops per ``fn(*args)`` call on the first GPU, from a trace of
    ``reps`` synchronized calls (after two untraced warm-up calls); None without a GPU.

    The time of the ops, not of the gaps between them: a call of one kernel measures that
    kernel; a call of many on one stream, their sum (the gaps between back-to-back kernels are
    about a microsecond each).
    """
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(reps):
                jax.block_until_ready(fn(*args))
        plane = first_gpu(load_trace(trace_dir))
    return None if plane is None else busy_ns(plane) / reps / 1e6
