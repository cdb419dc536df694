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
# The distributed Dion3 tests and the FSDP step benchmark in one command, on a machine with
# several NVIDIA GPUs of one host (2, 4 or 8). Ends within 540 s.
#
#   bash scripts/gpu_multi.sh              # on the GPU machine, repo root as cwd (not installed:
#                                          # PYTHONPATH=. is set here), python3 with jax[cuda]
#   bash scripts/gpu_multi.sh --cpu-smoke  # the same path on 8 simulated CPU devices (< 2 min)
#   bash scripts/gpu_multi.sh --cpu-smoke 2  # a rehearsal of a 2-GPU run: the whole test files
#                                            # and the benchmark on 2 simulated devices (~3 min)
#
# Writes to $DION3_OUT (default runs/gpu_multi_<UTC time>/): info.txt (nvidia-smi, jax.devices()),
# pytest.log + junit.xml (tests/test_distributed.py, tests/test_replica_sync.py on the GPUs:
# DION3_TEST_PLATFORM=gpu), bench.log (benchmarks/bench_step.py --fsdp: AdamW, optax muon,
# Dion3 f ∈ {1, 1/4}, megabatching on and off; per step: ms, collectives, bytes moved).
# Environment: PYTHON (default python3; .venv/bin/python with --cpu-smoke if present);
# TESTS_K (a pytest -k expression: only those tests); NO_BENCH=1 (tests only).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# NVLink multicast (NVLS) stays off, as in every multi-GPU measurement of docs/BENCHMARKS.md.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

SMOKE=0
SMOKE_N=""
case "${1:-}" in
  --cpu-smoke) SMOKE=1; SMOKE_N=${2:-} ;;
  "") ;;
  *) echo "usage: $0 [--cpu-smoke [N]]" >&2; exit 2 ;;
esac
if [[ -n $SMOKE_N && ! $SMOKE_N =~ ^[1-8]$ ]]; then
  echo "--cpu-smoke N: N must be 1 to 8 simulated devices, got '$SMOKE_N'" >&2; exit 2
fi

if [[ $SMOKE == 1 ]]; then
  PY=${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
  export JAX_PLATFORMS=cpu DION3_TEST_PLATFORM=cpu
  export XLA_FLAGS="--xla_force_host_platform_device_count=8 ${XLA_FLAGS:-}"
  T_INFO=60 T_BENCH=90
  if [[ -n $SMOKE_N ]]; then
    # A rehearsal of an N-GPU run: the whole files on the first N of the 8 devices.
    export DION3_TEST_NUM_DEVICES=$SMOKE_N
    T_TEST=400
    PYTEST_SEL=(-n 2)
  else
    # A quick subset on the CPU (the whole files run in CI); on the GPUs everything runs.
    T_TEST=150
    PYTEST_SEL=(-k "local_scope or two_all_to_alls or replicated or random_compressed or bytes_over")
  fi
  BENCH=(--small --reps 1 --cpu-devices "${SMOKE_N:-8}")
else
  PY=${PYTHON:-python3}
  export DION3_TEST_PLATFORM=gpu
  T_INFO=60 T_TEST=230 T_BENCH=250
  PYTEST_SEL=(${TESTS_K:+-k "$TESTS_K"})
  BENCH=(--reps 5 --compile-workers 8 --show-collectives)
fi

DEST=${DION3_OUT:-runs/gpu_multi_$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$DEST"
echo "# gpu_multi.sh: writing to $DEST (smoke=$SMOKE)"
START=$SECONDS

# 1. The machine.
{
  date -u
  git rev-parse HEAD 2>/dev/null || true
  env | grep -E '^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS|XLA_FLAGS|JAX_PLATFORMS|DION3_TEST_PLATFORM)=' | sort
  if command -v nvidia-smi >/dev/null; then nvidia-smi; nvidia-smi topo -m || true; fi
  timeout -k 5 "$T_INFO" "$PY" -c '
import jax, os
p = os.environ.get("DION3_TEST_PLATFORM")
print("jax", jax.__version__, "default backend:", jax.default_backend())
print("jax.devices():", jax.devices())
print(p, "devices:", len(jax.devices(p)))
'
} 2>&1 | tee "$DEST/info.txt"
info_rc=${PIPESTATUS[0]}

# 2. The distributed tests on the GPUs (meshes (N,), (2, N/2), and (4, 2) when N = 8).
timeout -k 10 "$T_TEST" "$PY" -m pytest tests/test_distributed.py tests/test_replica_sync.py \
  -q -rA -p no:cacheprovider --junitxml="$DEST/junit.xml" "${PYTEST_SEL[@]}" 2>&1 \
  | tee "$DEST/pytest.log"
test_rc=${PIPESTATUS[0]}

# 3. The step benchmark, FSDP over all devices. Megabatched variants run first; on a timeout
#    (SIGTERM) the script prints the table of the rows done so far.
bench_rc=0
if [[ ${NO_BENCH:-0} != 1 ]]; then
  timeout -k 10 "$T_BENCH" "$PY" benchmarks/bench_step.py --fsdp --no-megabatch \
    --fractions 1 0.25 --methods gram --backends auto "${BENCH[@]}" 2>&1 | tee "$DEST/bench.log"
  bench_rc=${PIPESTATUS[0]}
fi

echo "# gpu_multi.sh done in $((SECONDS - START)) s: info rc=$info_rc, pytest rc=$test_rc," \
  "bench rc=$bench_rc (124 = timed out); logs in $DEST" | tee -a "$DEST/info.txt"
[[ $info_rc == 0 && $test_rc == 0 && $bench_rc == 0 ]]
