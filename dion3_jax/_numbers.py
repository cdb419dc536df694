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
"""Which argument values count as numbers: Python and NumPy scalars alike.

Every constructor check asks these instead of ``isinstance(x, int)``, so that ``np.int64(4)``
and ``np.float32(0.25)`` are accepted wherever ``4`` and ``0.25`` are, and ``True`` is refused
wherever an int is expected (as ``np.True_`` is).
"""

from __future__ import annotations

import numbers

import numpy as np


def is_int(x) -> bool:
    """Whether ``x`` is a Python or NumPy integer scalar (not a bool)."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def is_real(x) -> bool:
    """Whether ``x`` is a Python or NumPy real scalar (int or float, not a bool)."""
    return is_int(x) or isinstance(x, (float, np.floating))


def is_scalar_number(x) -> bool:
    """Whether ``x`` is a real scalar or a 0-d NumPy array of a real dtype (what ``float()``
    takes without loss of meaning); bools excluded."""
    if isinstance(x, np.ndarray):
        return x.ndim == 0 and x.dtype.kind in "iuf"
    return is_real(x) or (isinstance(x, numbers.Real) and not isinstance(x, bool))
