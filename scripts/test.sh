#!/usr/bin/env bash
# The README's test command: set up the pinned environment (Python >= 3.12, jax 0.11.2) and run
# the test suite on the CPU, printing the 15 slowest tests. Extra arguments go to pytest, e.g.
#   bash scripts/test.sh -m "not slow"     # the fast loop
#   bash scripts/test.sh tests/test_polar.py
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m pytest -n 2 --dist worksteal -q --durations=15 "$@"
