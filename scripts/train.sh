#!/usr/bin/env bash
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
# The main job: train a byte-level transformer LM on the Python standard library's sources with
# Dion3, NorMuon and AdamW side by side (same initialization, same batches). On the CPU: the
# small budget (400 steps, one seed); on a GPU: the quality study's 25M-parameter model for 1800
# steps with three seeds (examples/train_lm.py --budget, docs/TRAINING.md). Each run writes its
# table, results and plot into a new folder runs/train_lm/<YYYYmmdd-HHMMSS>/ (or --out DIR).
# Usage: bash scripts/train.sh [flags of examples/train_lm.py]   (e.g. --help, --steps 200)
#
# The Python that runs it, the first that applies:
#   1. $DION3_PYTHON, if set: an interpreter that has jax, optax and flax (nothing is installed);
#   2. on a machine with an NVIDIA GPU (nvidia-smi lists one) and DION3_VENV unset: python3 on
#      the PATH, if its JAX sees the GPU. The pinned environment of step 3 holds JAX's CPU build
#      only, so on such a machine it would train on the CPU;
#   3. the pinned environment, created first if needed (scripts/setup_env.sh: .venv, or
#      $DION3_VENV).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY=""

# Prints the versions and returns 0 if "$1" imports jax, optax and flax and JAX's first device
# is a GPU.
sees_gpu() {
  "$1" - <<'PY' 2>/dev/null
import jax, optax, flax
assert jax.devices()[0].platform == "gpu"
print(f"jax {jax.__version__}, optax {optax.__version__}, flax {flax.__version__}; "
      f"{jax.devices()[0].device_kind}")
PY
}

if [ -n "${DION3_PYTHON:-}" ]; then
  PY="$DION3_PYTHON"
  echo "train.sh: using DION3_PYTHON=$PY"
elif [ -z "${DION3_VENV:-}" ] && command -v nvidia-smi >/dev/null 2>&1 \
    && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  if command -v python3 >/dev/null 2>&1 && VERSIONS="$(sees_gpu python3)"; then
    PY="$(command -v python3)"
    echo "train.sh: an NVIDIA GPU is here and $PY's JAX sees it ($VERSIONS); using it" \
         "(set DION3_VENV to use the pinned environment instead; its JAX is the CPU build)"
  else
    echo "train.sh: an NVIDIA GPU is here, but python3's JAX does not see it; using the" \
         "pinned environment, which trains on the CPU (install JAX's CUDA build into a Python" \
         "and set DION3_PYTHON to it)" >&2
  fi
fi
if [ -z "$PY" ]; then
  bash scripts/setup_env.sh
  PY="${DION3_VENV:-$ROOT/.venv}/bin/python"
fi
exec "$PY" examples/train_lm.py "$@"
