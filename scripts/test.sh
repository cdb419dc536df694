#!/usr/bin/env bash
# The README's test command: set up the pinned environment (Python >= 3.12, jax 0.11.2) and run
# the whole test suite on the CPU. Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m pytest -n 2 -q "$@"
