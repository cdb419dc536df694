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
"""The Newton-Schulz toolkit behind :func:`dion3_jax.polar`.

* :func:`gram_newton_schulz` and :func:`standard_newton_schulz`: the iterations on a normalized
  ``(batch, rows, cols)`` batch, for a resolved coefficient list;
* :data:`COEFFICIENT_PRESETS` and :func:`get_coefficients`: the ``(a, b, c)`` triples per step
  (presets ``"polar_express"``, ``"polar_express_4"``, ``"you"``, ``"jordan"``, or a user's
  sequence);
* :func:`autotune_restarts` and :func:`restart_growth`: where Gram Newton-Schulz should restart
  for a coefficient list, from the growth of ``Q`` under float16's spurious Gram eigenvalues.

The restart autotune also runs from the command line (``--help`` lists the options)::

    python -m dion3_jax.newton_schulz --coefficients polar_express [--steps N]
        [--spurious -4e-4] [--max-growth X] [--max-restarts K] [--num-restarts K]

Examples:
  >>> from dion3_jax import newton_schulz
  >>> len(newton_schulz.get_coefficients("polar_express"))
  5
  >>> newton_schulz.autotune_restarts("jordan")
  (3,)
"""

from dion3_jax._coefficients import PRESETS as COEFFICIENT_PRESETS
from dion3_jax._coefficients import get_coefficients
from dion3_jax._polar import gram_newton_schulz, standard_newton_schulz
from dion3_jax._restarts import autotune_restarts, main as _main, restart_growth

__all__ = (
    "COEFFICIENT_PRESETS",
    "autotune_restarts",
    "get_coefficients",
    "gram_newton_schulz",
    "restart_growth",
    "standard_newton_schulz",
)

if __name__ == "__main__":
    raise SystemExit(_main())
