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
"""``benchmarks/profile_kernel.py``'s trace summary, on a hand-made Mosaic GPU trace (the
profiler itself needs a Hopper GPU)."""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import profile_kernel  # noqa: E402
from seeds import module_seed  # noqa: E402

pytestmark = pytest.mark.tooling

#: Fresh random inputs per run, printed with every test (tests/seeds.py).
SEED = module_seed()


def _trace(rng, ctas: int):
    """Two items per CTA; compute warpgroups 0 and 1 record mainloop then epilogue per item;
    the memory warpgroup (2) records nothing. Returns the events and the true spans."""
    events, truth = [], {}
    for cta in range(ctas):
        for wg in (0, 1):
            tid, t = 1 + wg + 3 * cta, float(rng.uniform(0, 5))
            for _ in range(2):
                for name in ("mainloop", "epilogue"):
                    d = float(rng.uniform(1, 100))
                    truth.setdefault((name, wg), []).append(d)
                    events += [{"name": name, "ph": "B", "ts": t, "tid": tid},
                               {"name": name, "ph": "E", "ts": t + d, "tid": tid}]
                    t += d
    return events, truth


def test_scope_spans_pairs_begin_and_end_per_warpgroup():
    events, truth = _trace(np.random.default_rng(SEED), ctas=5)
    spans = profile_kernel.scope_spans(events)
    assert spans.keys() == truth.keys()
    for key, values in truth.items():
        np.testing.assert_allclose(sorted(spans[key]), sorted(values), rtol=1e-12)


def test_summary_reports_each_scope_and_the_kernel_span():
    events, truth = _trace(np.random.default_rng(SEED), ctas=3)
    lines = profile_kernel.summary(events)
    rows = {(ln.split()[0], int(ln.split()[1])): ln.split() for ln in lines[1:-1]}
    assert rows.keys() == truth.keys()
    for key, values in truth.items():
        assert int(rows[key][2]) == len(values)
        assert abs(float(rows[key][3]) - np.mean(values)) < 0.006
    ts = [e["ts"] for e in events]
    assert lines[-1].endswith(f"{max(ts) - min(ts):.1f} µs")


@pytest.mark.parametrize("batch", [1, 3])
def test_operands_are_gram_like_and_batched(batch):
    """``operands``: ``sym_matmul``'s operands are one symmetric Gram matrix (``k == n``) and
    ``syrk``'s an ``(n, k)`` matrix, with a leading axis of ``batch`` when it is above 1."""
    lead = (batch,) if batch > 1 else ()
    r, b, c = profile_kernel.operands("sym_matmul", 64, 64, batch)
    assert r.shape == b.shape == c.shape == (*lead, 64, 64) and r.dtype == np.float16
    # (symmetric up to the float32 product's summation order and one float16 rounding)
    np.testing.assert_allclose(np.asarray(r, np.float32),
                               np.swapaxes(np.asarray(r, np.float32), -1, -2), atol=2e-3)
    (x,) = profile_kernel.operands("syrk", 32, 96, batch)
    assert x.shape == (*lead, 32, 96)
