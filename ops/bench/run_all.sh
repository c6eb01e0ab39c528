#!/usr/bin/env bash
# Everything the GPU machine measures, most important first, each stage bounded in time so that a slow or failing
# stage cannot starve the next: end to end through Redis (2B bf16, 2B FP8; each also times its engine in process
# and the reference engine), the GPU tests, then the other shapes and mixes in process.
# Usage: ops/bench/run_all.sh OUTDIR [STAGE...]   stages: delta-rule e2e-bf16 e2e-fp8 tests mixes (default: all, in
# that order; delta-rule is the host and GPU time of the gated delta rule per pack, fla's dispatch against FlashQLA
# called directly)
# Stage limits in seconds: E2E_TIMEOUT, TEST_TIMEOUT, MIX_TIMEOUT. A cold machine needs about 3 minutes before the
# first end-to-end worker is ready (static-shape compilation, FlashQLA's kernels); where one command may run only
# 10 minutes, run the stages in separate commands on the same machine (kernel caches stay warm).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: run_all.sh OUTDIR [STAGE...]}
shift
stages=${*:-delta-rule e2e-bf16 e2e-fp8 tests mixes}
want() { [[ " $stages " == *" $1 "* ]]; }
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false DQ_GPU_REPORT="$out/gpu-tests.jsonl"
PY=${PYTHON:-python3}
start=$SECONDS
stage() { echo "== $1 at $((SECONDS - start)) s"; }

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c 'import torch, transformers, fla; print("torch", torch.__version__, "transformers", transformers.__version__, "fla", fla.__version__)'
  $PY -c 'import flash_qla; print("flash_qla", flash_qla.__version__)' 2>&1 | tail -1
  echo "cpus $(nproc)"; } >"$out/machine.txt" 2>&1
cat "$out/machine.txt"

want delta-rule && { stage "delta rule per pack"
timeout "${DELTA_TIMEOUT:-120}" $PY ops/bench/delta_rule.py --out "$out" >"$out/delta_rule.log" 2>&1
echo "exit $?"; tail -n 12 "$out/delta_rule.log"; }

for dtype in bf16 fp8; do
  want "e2e-$dtype" || continue
  stage "end to end 2b $dtype"
  flag=$([ "$dtype" = fp8 ] && echo --fp8)
  timeout "${E2E_TIMEOUT:-320}" $PY ops/bench/end_to_end.py --shape 2b $flag --requests "${E2E_REQUESTS:-3000}" \
    --latency-seconds 10 --out "$out/e2e-2b-$dtype" >"$out/e2e-2b-$dtype.log" 2>&1
  echo "exit $?"; tail -n 40 "$out/e2e-2b-$dtype.log"
  pkill -f "end_to_end.py --worker" 2>/dev/null; sleep 1  # a worker left by a killed stage holds the GPU
done

want tests && { stage "gpu tests"
timeout "${TEST_TIMEOUT:-300}" $PY -m pytest -q -s -p no:cacheprovider tests/gpu >"$out/gpu-tests.log" 2>&1
echo "exit $?"; grep -E "passed|failed|RESULT" "$out/gpu-tests.log" | tail -n 30; }

want mixes && { stage "other shapes and mixes, in process"
timeout "${MIX_TIMEOUT:-240}" $PY ops/bench/fast_path.py \
  --runs 0.8b:standard:bf16,4b:standard:bf16,2b:long-tail:bf16,2b:vision:bf16 --deadline-s $(( ${MIX_TIMEOUT:-240} - 30 )) \
  --out "$out/mixes" >"$out/mixes.log" 2>&1
echo "exit $?"; tail -n 20 "$out/mixes.log"; }
stage "done"
