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
# The single-GPU measurements of docs/BENCHMARKS.md, each part time-boxed. Runs from the
# repository root on an NVIDIA GPU machine whose python3 has jax with CUDA; the repository need
# not be installed (it is put on PYTHONPATH). For the "jax_triton" rows, put a jax-triton wheel in
# $DION3_WHEELS (see docs/KERNELS.md); it is installed into $DION3_SITE.
#
#   bash scripts/gpu_bench.sh kernels   # GPU kernel tests + kernel table with variants + polar
#   bash scripts/gpu_bench.sh peers     # the symmetric kernels against cuBLAS at the step's shapes
#   bash scripts/gpu_bench.sh phases    # main loop against epilogue per item at the step's shapes
#   bash scripts/gpu_bench.sh step      # optimizer-step benchmark (7B shapes), all variants
#   bash scripts/gpu_bench.sh commits   # the step of an older commit against the working tree
#   bash scripts/gpu_bench.sh host      # device and host time per step, command buffers on/off
#   bash scripts/gpu_bench.sh payload   # the payload kernel's launch parameters, per shape group
#   bash scripts/gpu_bench.sh layout    # the passes with the momentum in three layouts
#   bash scripts/gpu_bench.sh compile   # the step's GPU compile time against AdamW's (8 layers)
#   bash scripts/gpu_bench.sh compile-autotune   # the same, also with GEMM autotuning off
#   bash scripts/gpu_bench.sh cold-start   # the compile with a cold, then a warm persistent cache
#   bash scripts/gpu_bench.sh polar-shapes   # Gram against standard NS on the step's payloads
#   bash scripts/gpu_bench.sh step-gram profile kernels-table   # parts run in the given order
#
#   bash scripts/gpu_bench.sh --split "kernels" "step-all"   # on a machine of 2 GPUs: the
#       first list of parts on GPU 0 and the second on GPU 1 at the same time (each process sees
#       one GPU); their logs in $DION3_OUT/gpu0.log, $DION3_OUT/gpu1.log, every file packed in
#       $DION3_OUT/logs.tgz
#
# Environment:
#   DION3_OUT     where logs and tables go (default runs/gpu_bench)
#   DION3_WHEELS  a folder of wheels to install without an index (default .whl; optional)
#   DION3_SITE    where those wheels are installed (default runs/site)
set -uo pipefail
[ $# -gt 0 ] || set -- kernels
DEST="${DION3_OUT:-runs/gpu_bench}"
WHEELS="${DION3_WHEELS:-.whl}"
SITE="${DION3_SITE:-runs/site}"
mkdir -p "$DEST"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ls "$WHEELS"/*.whl >/dev/null 2>&1 && [ ! -d "$SITE/jax_triton" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
    "$WHEELS"/*.whl
fi
[ -d "$SITE/jax_triton" ] && export PYTHONPATH="$(cd "$SITE" && pwd):$PYTHONPATH"

if [ "$1" = --split ]; then
  [ $# -eq 3 ] || { echo 'usage: gpu_bench.sh --split "PARTS for GPU 0" "PARTS for GPU 1"'; exit 2; }
  root=$(mktemp -d)  # the two halves' files, packed into one archive at the end
  # shellcheck disable=SC2086  # each list is split into its parts on purpose
  CUDA_VISIBLE_DEVICES=0 DION3_OUT="$root/gpu0" bash "$0" $2 > "$root/gpu0.log" 2>&1 &
  p0=$!
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=1 DION3_OUT="$root/gpu1" bash "$0" $3 > "$root/gpu1.log" 2>&1 &
  p1=$!
  wait $p0; rc0=$?
  wait $p1; rc1=$?
  tar czf "$DEST/logs.tgz" -C "$root" gpu0 gpu1 gpu0.log gpu1.log
  cp "$root/gpu0.log" "$root/gpu1.log" "$DEST/"
  grep -h -E '^== |^\| |passed|failed' "$root/gpu0.log" "$root/gpu1.log"
  echo "GPU 0 ($2) rc=$rc0; GPU 1 ($3) rc=$rc1"
  exit $((rc0 || rc1))
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$DEST/gpu.txt"
python3 -c "import jax, pallas_kernels; print(jax.__version__, jax.devices(), pallas_kernels.available_implementations())" | tee -a "$DEST/gpu.txt"
date -u | tee -a "$DEST/gpu.txt"

run() {  # run NAME SECONDS CMD...: time-boxed, logged to $DION3_OUT/NAME.txt
  local name=$1 secs=$2; shift 2
  echo "== $name (limit ${secs}s): $*"
  timeout "$secs" "$@" 2>&1 | tee "$DEST/$name.txt"
  echo "== $name rc=${PIPESTATUS[0]}"
}

for PART in "$@"; do
case "$PART" in
  kernels)  # GPU kernel tests, kernel table with the pipeline-depth variants, polar per backend.
    run kernel_tests 290 python3 -m pytest -q -rs tests/test_kernels_gpu.py
    run bench_kernels 280 python3 benchmarks/bench_kernels.py --polar --reps 20 --variants \
      --json "$DEST/bench_kernels.jsonl"
    ;;
  kernels-table)  # The kernel table with the default configurations only, polar per backend.
    run bench_kernels 150 python3 benchmarks/bench_kernels.py --polar --reps 20 \
      --json "$DEST/bench_kernels.jsonl"
    ;;
  peers)  # The symmetric kernels against cuBLAS per computed tile at the 8-layer step's Gram and
          # payload shapes (f = 1, 1/4, 1/8), then the kernel table at the same shapes (XLA
          # against the kernels: device time, errors).
    shapes="16x2816x2816 32x1024x1024 8x1024x1024 16x1408x1408 32x512x512 8x512x512"
    payloads="16x2816x4096 32x1024x4096 8x1024x11008 16x1408x4096 32x512x4096 8x512x11008"
    # shellcheck disable=SC2086  # the lists are split into their shapes on purpose
    run bench_peers 290 python3 benchmarks/bench_kernels.py --no-kernels --peers --reps 20 \
      --peer-shapes 4096x4096 8x4096x4096 $shapes $payloads
    # shellcheck disable=SC2086
    run bench_kernels_step_shapes 280 python3 benchmarks/bench_kernels.py --reps 20 \
      --shapes $shapes $payloads --json "$DEST/bench_kernels_step_shapes.jsonl"
    ;;
  phases)  # Main loop against epilogue per work item (Mosaic GPU's in-kernel profiler), for
           # sym_matmul with β·c at the step's Gram sizes and at 4096², and for syrk at 1024.
    for shape in "1 4096" "16 2816" "16 1408" "32 1024"; do
      read -r batch n <<< "$shape"
      run "phases_sym_$n" 120 python3 benchmarks/profile_kernel.py --batch "$batch" --n "$n" \
        --k "$n"
    done
    run phases_syrk_1024 120 python3 benchmarks/profile_kernel.py --op syrk --batch 32 --n 1024 \
      --k 4096
    ;;
  polar-test)  # Gram NS through the kernels against XLA's (the last GPU test, on its own).
    run polar_tests 90 python3 -m pytest -q -rs tests/test_kernels_gpu.py -k gram_ns
    ;;
  step)
    # The most important rows first (each part is time-boxed; a stopped part still prints the
    # rows it finished): AdamW, optax Muon, Dion3 Gram NS on the Mosaic kernels at every f; then
    # XLA and Triton, Gram and standard NS, at f = 1/4. Step times only (--no-polar).
    run bench_step_gram 300 python3 benchmarks/bench_step.py --no-polar --methods gram \
      --backends mosaic --fractions 0.25 0.125 1 0.5
    run bench_step_more 170 python3 benchmarks/bench_step.py --no-polar --no-baselines \
      --methods gram standard --backends xla jax_triton --fractions 0.25
    ;;
  step-all)  # Every row of the step table in ONE process (rows compared only within one run):
             # the variants compile on 8 threads first, then run one after another.
    run bench_step_all 540 python3 benchmarks/bench_step.py --compile-workers 8 --no-polar
    ;;
  commits)  # The default step (f = 1 and 1/4) of commit ${OLD_COMMIT:-b467ab5} against the
            # working tree, in one process, timed in interleaved rounds.
    run bench_commits 540 python3 benchmarks/bench_commits.py --commit "${OLD_COMMIT:-b467ab5}"
    ;;
  step-gram)  # Baselines and Dion3 Gram NS on the Mosaic kernels at f = 1, 1/4, 1/2.
    run bench_step_gram 200 python3 benchmarks/bench_step.py --methods gram --backends mosaic \
      --fractions 1 0.25 0.5
    ;;
  profile)  # Where the f = 1/4 step spends its time (jax.profiler, per op kind).
    run profile_step 120 python3 benchmarks/profile_step.py --fraction 0.25
    ;;
  polar-shapes)  # Gram against standard Newton-Schulz (both float16, Mosaic products) on the
                 # step's payload stacks at f = 1, 1/4, 1/8 and on an aspect-ratio sweep.
    run bench_polar_shapes 400 python3 benchmarks/bench_polar.py --shapes step 8x2304x2048 \
      8x2560x2048 8x3072x2048 8x4096x2048 --variants gram:float16 standard:float16 \
      --backends mosaic --no-optax --reps 10
    ;;
  host)  # Device and host time per step, with and without XLA's command buffers (CUDA graphs),
         # AdamW and Dion3 Gram NS (Mosaic) at f = 1, 1/4, 1/8 in one process; then the host's
         # events while the GPU idles before each step, for Dion3 at f = 1/4 and for AdamW.
    run bench_step_host 300 python3 benchmarks/bench_step.py --methods gram --backends mosaic \
      --fractions 1 0.25 0.125 --no-polar --compile-workers 8 --reps 10 \
      --xla-option xla_gpu_enable_command_buffer=
    run profile_host 100 python3 benchmarks/profile_step.py --fraction 0.25 --host --top 20
    run profile_host_adamw 60 python3 benchmarks/profile_step.py --optimizer adamw --host --top 12
    ;;
  layout)  # The statistics pass, payload gather and parameter pass over the 8-layer step's
           # leaves, with the momentum in the leaf's (in, out) layout against (out, in) and
           # against (in/8, out, 8) blocks (a selected column reads whole 32-byte sectors).
    run bench_layout 300 python3 benchmarks/bench_layout.py
    ;;
  payload)  # The payload pass alone per shape group of the 7B-shapes step at f = 1/4 and 1:
            # the kernel's default tiles and 2048-element ones against XLA's pass that writes
            # only the momenta, the same traffic without the payloads (device time, bandwidth,
            # bitwise check).
    run bench_payload 240 python3 benchmarks/bench_payload.py --fractions 0.25 1 \
      --variants default b2048
    ;;
  compile)  # The step's GPU compile (trace, lowering, XLA compile) against AdamW's, 8 layers,
            # f = 1 and 1/4, two interleaved rounds; each also with no kernel (the kernels'
            # share of each stage).
    run bench_compile 300 python3 benchmarks/bench_compile.py --layers 8 --fractions 1 0.25 \
      --repeats 2 --no-kernel-rows
    ;;
  compile-autotune)  # The same, also with XLA's GEMM autotuning off: the autotuner's share.
    run bench_compile_autotune 300 python3 benchmarks/bench_compile.py --layers 8 \
      --fractions 1 0.25 --xla-option xla_gpu_autotune_level=0
    ;;
  cold-start)  # The step's compile with JAX's persistent compilation cache: a first process
               # fills an empty cache, a second one compiles the same steps from it (what a
               # repeated run pays: its trace and lowering, and loading the executables); each
               # step is then run twice (--first-call).
    cache=$(mktemp -d)
    run cold_start_fill 300 python3 benchmarks/bench_compile.py --layers 8 --fractions 1 0.25 \
      --cache-dir "$cache" --first-call
    run cold_start_warm 300 python3 benchmarks/bench_compile.py --layers 8 --fractions 1 0.25 \
      --cache-dir "$cache" --first-call
    du -sh "$cache" | tee -a "$DEST/cold_start_warm.txt"
    rm -rf "$cache"
    ;;
  selection)  # Row write-back / gather formulations alone, then where the f = 1/4 step's time goes.
    run bench_selection 90 python3 benchmarks/bench_selection.py
    run profile_step 120 python3 benchmarks/profile_step.py --fraction 0.25 --top 12 \
      --show-hlo loop_gather_fusion loop_add_select_fusion input_reduce_fusion
    ;;
  *) echo "unknown part $PART (kernels | kernels-table | peers | phases | polar-test | step | step-all | commits | step-gram | profile | polar-shapes | host | payload | compile | compile-autotune | cold-start | selection)"
     exit 2 ;;
esac
done
