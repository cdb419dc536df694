#!/usr/bin/env bash
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
