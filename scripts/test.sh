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
# The README's test command: set up one end of the tested version range (Python >= 3.12; the
# lower end, jax 0.11.2, unless --latest) and run the test suite on the CPU, printing the 15
# slowest tests. Extra arguments go to pytest, e.g.
#   bash scripts/test.sh -m "not slow"              # the fast loop
#   bash scripts/test.sh --latest -m "not slow"     # the fast loop on the newest jax, flax, orbax
#   bash scripts/test.sh tests/test_polar.py
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STACK=lower VENV="$ROOT/.venv"
if [ "${1:-}" = "--latest" ]; then
  STACK=latest VENV="$ROOT/.venv-latest"
  shift
fi
bash "$ROOT/scripts/setup_env.sh" "$STACK"
cd "$ROOT"
exec "$VENV/bin/python" -m pytest -n 2 --dist worksteal -q --durations=15 "$@"
