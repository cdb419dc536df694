#!/usr/bin/env bash
# The main job: train a byte-level transformer LM on the Python standard library's sources with
# Dion3, NorMuon and AdamW side by side (same initialisation, same batches). Creates the virtual
# environment first if needed. Each run writes its table, results and plot into a new folder
# runs/train_lm/<YYYYmmdd-HHMMSS>/ (or --out DIR).
# Usage: bash scripts/train.sh [flags of examples/train_lm.py]   (e.g. --help, --steps 200)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_env.sh
exec "${DION3_VENV:-$ROOT/.venv}/bin/python" examples/train_lm.py "$@"
