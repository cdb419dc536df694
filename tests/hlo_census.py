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
"""Reading collectives off compiled HLO text: how many, and how large their results are."""

from __future__ import annotations

import re

import numpy as np


def count_op(hlo: str, op: str) -> int:
    """Number of ``op`` instructions (sync or async start) in compiled HLO text."""
    return len(re.findall(rf" {op}(?:-start)?\(", hlo))


def op_result_sizes(hlo: str, op: str) -> list[int]:
    """Number of elements of each array an ``op`` instruction returns: one entry per element of
    a tuple result (XLA's GPU collective combiners merge several gathers into one tuple-shaped
    instruction)."""
    sizes = []
    for line in hlo.splitlines():
        m = re.search(rf"= (.*) {op}(?:-start)?\(", line)
        if m:
            dims = re.findall(r"[a-z]+[0-9]*\[([0-9,]*)\]", m.group(1))
            sizes += [int(np.prod([int(d) for d in ds.split(",") if d] or [1])) for ds in dims]
    return sizes
