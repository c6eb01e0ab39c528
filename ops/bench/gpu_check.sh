#!/usr/bin/env bash
# The fast path on a GPU machine: a fail-fast smoke test (eager fast path vs the reference), the benchmark, then
# the remaining GPU tests. Every figure lands under OUTDIR. Usage: ops/bench/gpu_check.sh OUTDIR [BENCH_RUNS]
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: gpu_check.sh OUTDIR [BENCH_RUNS]}
runs=${2:-2b:standard:bf16,2b:standard:fp8,2b:long-tail:bf16,2b:vision:bf16,0.8b:standard:bf16,4b:standard:bf16,2b:standard:bf16:eager}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false DQ_GPU_REPORT="$out/gpu-tests.jsonl"
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv >"$out/gpu.txt" 2>&1
$PY -c 'import torch, transformers, fla; print(torch.__version__, transformers.__version__, fla.__version__)' \
  2>&1 | tee -a "$out/gpu.txt"
$PY -c 'import flash_qla; print("flash_qla", flash_qla.__version__)' 2>&1 | tail -1 | tee -a "$out/gpu.txt"
start=$SECONDS
timeout "${SMOKE_TIMEOUT:-180}" $PY -m pytest -x -q -s -p no:cacheprovider tests/gpu -k "eager and reference" 2>&1 \
  | tee "$out/smoke.log" || { echo "smoke test failed"; exit 1; }
echo "smoke: $((SECONDS - start)) s"
timeout "${BENCH_TIMEOUT:-240}" $PY ops/bench/fast_path.py --runs "$runs" --profile 2b:standard:bf16 \
  --deadline-s "${BENCH_DEADLINE:-170}" --out "$out/bench" 2>&1 | tee "$out/bench.log"
echo "bench: $((SECONDS - start)) s"
timeout "${TEST_TIMEOUT:-200}" $PY -m pytest -q -s -p no:cacheprovider tests/gpu -k "not (eager and reference)" 2>&1 \
  | tee "$out/gpu-tests.log"
echo "tests: $((SECONDS - start)) s"
