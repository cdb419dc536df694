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
# Dion3, NorMuon and AdamW side by side (same initialization, same batches). Creates the virtual
# environment first if needed. Each run writes its table, results and plot into a new folder
# runs/train_lm/<YYYYmmdd-HHMMSS>/ (or --out DIR).
# Usage: bash scripts/train.sh [flags of examples/train_lm.py]   (e.g. --help, --steps 200)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_env.sh
exec "${DION3_VENV:-$ROOT/.venv}/bin/python" examples/train_lm.py "$@"
