#!/usr/bin/env bash
# The main job: train a byte-level transformer LM on the Python standard library's sources with
# Dion3 and, side by side, AdamW. Creates the virtual environment first if needed.
# Usage: bash scripts/train.sh [flags of examples/train_lm.py]   (e.g. --help, --steps 200)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_env.sh
exec "${DION3_VENV:-$ROOT/.venv}/bin/python" examples/train_lm.py "$@"
