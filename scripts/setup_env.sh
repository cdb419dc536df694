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
# Create (or reuse) a virtual environment with a Python >= 3.12 and one end of the tested
# version range, pinned exactly:
#   bash scripts/setup_env.sh           # .venv: the lower end, requirements-ci.txt (jax 0.11.2)
#   bash scripts/setup_env.sh latest    # .venv-latest: the upper end, requirements-ci-latest.txt
#   bash scripts/setup_env.sh cuda-compile  # .venv-cuda-compile: the lower end and JAX's CUDA
#                                           # plugin, to compile for a GPU without one
# DION3_VENV overrides the environment's folder.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
case "${1:-lower}" in
  lower) REQS="$ROOT/requirements-ci.txt"; DEFAULT_VENV="$ROOT/.venv" ;;
  latest) REQS="$ROOT/requirements-ci-latest.txt"; DEFAULT_VENV="$ROOT/.venv-latest" ;;
  cuda-compile) REQS="$ROOT/requirements-ci-cuda-compile.txt"
                DEFAULT_VENV="$ROOT/.venv-cuda-compile" ;;
  *) echo "setup_env: unknown stack '$1' (lower, latest or cuda-compile)" >&2; exit 2 ;;
esac
VENV="${DION3_VENV:-$DEFAULT_VENV}"

find_python() {
  local c v
  for c in "${PYTHON:-}" python3.12 python3; do
    [ -n "$c" ] || continue
    command -v "$c" >/dev/null 2>&1 || continue
    if "$c" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; then
      command -v "$c"; return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    # prefer 3.12 (the GPU machine's version), then any newer one
    for v in $(ls "$(pyenv root)/versions" 2>/dev/null | sort -V | awk -F. '$1==3 && $2==12'; ls "$(pyenv root)/versions" 2>/dev/null | sort -V -r); do
      c="$(pyenv root)/versions/$v/bin/python3"
      if [ -x "$c" ] && "$c" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; then
        echo "$c"; return 0
      fi
    done
  fi
  return 1
}

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)'; then
  PY="$(find_python)" || { echo "setup_env: no Python >= 3.12 found (set PYTHON=/path/to/python3.12)" >&2; exit 1; }
  echo "setup_env: creating $VENV with $PY"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.dion3_installed"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ] || [ "$REQS" -nt "$STAMP" ] \
    || [ "$ROOT/requirements-ci.txt" -nt "$STAMP" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -r "$REQS"
  "$VENV/bin/python" -m pip install -q --no-deps -e "$ROOT"
  touch "$STAMP"
fi
echo "setup_env: ready ($("$VENV/bin/python" -c 'import sys, jax; print("python", sys.version.split()[0], "jax", jax.__version__)'))"
