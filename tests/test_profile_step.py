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
"""benchmarks/profile_step.py's host accounting: the GPU's idle windows and the host events inside
them (hand-made planes: the CPU has no GPU plane)."""

from __future__ import annotations

import pathlib
import sys
from types import SimpleNamespace as NS

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import profile_step  # noqa: E402
from seeds import module_seed  # noqa: E402

pytestmark = pytest.mark.tooling

#: Fresh random inputs per run, printed with every test (tests/seeds.py).
SEED = module_seed()


def _event(name, start, duration):
    return NS(name=name, start_ns=int(start), duration_ns=int(duration))


def _trace(rng):
    """Two steps of GPU ops with an idle window between them; host events around it."""
    gap_start = int(rng.integers(10**6, 2 * 10**6))
    gap = int(rng.integers(3 * 10**5, 10**6))
    ops = [_event("a", 0, gap_start // 2), _event("b", gap_start // 2, gap_start - gap_start // 2),
           _event("c", gap_start + gap, 10**5), _event("d", gap_start + gap + 10**5 + 50, 10**5)]
    gpu = NS(name="/device:GPU:0", lines=[NS(name="XLA Ops", events=ops)])
    inside = int(rng.integers(1, gap // 2))
    host = NS(name="/host:CPU", lines=[NS(name="python3", events=[
        _event("launch", gap_start + gap - inside, 2 * inside),     # half of it in the window
        _event("prepare", gap_start + 10, inside),                   # wholly inside
        _event("before", 0, 1000)])])                                # outside
    return NS(planes=[host, gpu]), (gap_start, gap_start + gap), inside


def test_idle_windows_and_the_host_events_inside():
    rng = np.random.default_rng(SEED)
    data, window, inside = _trace(rng)
    # The 50 ns gap between c and d is below the threshold.
    assert profile_step.idle_windows(data) == [window]
    got = profile_step.host_in_windows(data, [window])
    assert got == {"launch": (float(inside), 1), "prepare": (float(inside), 1)}


def test_device_gaps_name_the_ops_on_both_sides():
    rng = np.random.default_rng(SEED)
    data, (start, end), _ = _trace(rng)
    # Two gaps: the window between b and c, and the 50 ns between c and d.
    assert profile_step.device_gaps(data) == [(end - start, "c", "b"), (50, "d", "c")]


def test_no_windows_without_a_gpu_plane():
    assert profile_step.idle_windows(NS(planes=[NS(name="/host:CPU", lines=[])])) == []
