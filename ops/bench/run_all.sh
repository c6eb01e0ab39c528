#!/usr/bin/env bash
# Everything the GPU machine measures, most important first, each stage bounded in time so that a slow or failing
# stage cannot starve the next: end to end through Redis (2B bf16, 2B FP8; each also times its engine in process
# and the reference engine), the GPU tests, then the other shapes and mixes in process.
# Usage: ops/bench/run_all.sh OUTDIR [STAGE...]   stages: delta-rule lone e2e-bf16 e2e-fp8 e2e-fp8-late e2e-bf16-warm
# e2e-bf16-2 e2e-bf16-3 e2e-bf16-det priority fidelity invariance invariance-det tests mixes (default: all but
# e2e-bf16-2/3 and the -det stages, in that order).
# lone is one request at a time, through the client and through the gateway, 2B bf16 (ops/bench/lone.py; LONE_FLAGS:
# more flags for its worker, e.g. the defaults before 1234dca: --buckets 2048,4096,8192,16384 --max-wait-ms 5).
# delta-rule is the host and GPU time of the gated delta rule per pack, fla's dispatch against FlashQLA called
# directly; e2e-fp8-late is the shipped FP8 setting, --fp8 --fp8-layers late; e2e-bf16-warm, -2 and -3 start a fresh
# bf16 worker again on the compile caches the earlier stages left (three fresh workers: the median is the figure);
# priority is high requests at 10% of the peak rate over a saturating normal backlog, 2B bf16, in PRIORITY_WORKERS
# fresh workers (default 3; OUTDIR/priority-2b-bf16, -2, -3) PRIORITY_REPEATS times each (default 1); fidelity is
# FP8 and bf16 against an fp32 reference at the 2B shape; invariance is a held-out set answered alone by one
# worker, then mixed into a backlog by a second, compared bitwise (2B bf16, ops/bench/invariance.py); e2e-bf16-det and invariance-det are the same with --deterministic (its cost:
# e2e-bf16-det against e2e-bf16 on the same machine). Named only, never by default: scaling (2B bf16 through one
# Redis on 1, 2, 4, 8 of the machine's GPUs, each count up to what it has; ops/bench/scaling.py).
# E2E_LOADS: the end-to-end latency phases, x the peak (default 0.5; 0.1,0.2,...,1.0 for latency against load,
# which ops/bench/plot.py draws); E2E_LATENCY_SECONDS: each phase's length (default 10); E2E_EPILOGUES: the workers'
# --epilogues in the end-to-end and invariance stages (worker/fast/epilogues.py; default the worker's own: until
# e7a3f4a the benchmarks' workers ran without them unless it was set).
# The workers share one compile cache, COMPILE_CACHE (default OUTDIR/compile-cache): the first end-to-end stage
# of a fresh OUTDIR starts cold, the later ones find what it compiled.
# Stage limits in seconds: LONE_TIMEOUT, E2E_TIMEOUT, SCALING_TIMEOUT, PRIORITY_TIMEOUT, FIDELITY_TIMEOUT,
# INVARIANCE_TIMEOUT, TEST_TIMEOUT, MIX_TIMEOUT. A cold machine needs about 4 minutes before the first end-to-end worker is ready
# (static-shape compilation, FlashQLA's kernels); where one command may run only 10 minutes, run the stages in
# separate commands on the same machine with the same OUTDIR.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: run_all.sh OUTDIR [STAGE...]}
shift
stages=${*:-delta-rule lone e2e-bf16 e2e-fp8 e2e-fp8-late e2e-bf16-warm priority fidelity invariance tests mixes}
want() { [[ " $stages " == *" $1 "* ]]; }
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false DQ_GPU_REPORT="$out/gpu-tests.jsonl"
PY=${PYTHON:-python3}
start=$SECONDS
stage() { echo "== $1 at $((SECONDS - start)) s"; }

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c 'import torch, transformers, fla; print("torch", torch.__version__, "transformers", transformers.__version__, "fla", fla.__version__)'
  $PY -c 'import flash_qla; print("flash_qla", flash_qla.__version__)' 2>&1 | tail -1
  echo "cpus $(nproc)"; echo "commit ${COMMIT:-$(git log --oneline -1 2>/dev/null)}"; } >"$out/machine.txt" 2>&1
cat "$out/machine.txt"

want delta-rule && { stage "delta rule per pack"
timeout "${DELTA_TIMEOUT:-120}" $PY ops/bench/delta_rule.py --out "$out" >"$out/delta_rule.log" 2>&1
echo "exit $?"; tail -n 12 "$out/delta_rule.log"; }

cache=${COMPILE_CACHE:-$out/compile-cache}
want lone && { stage "lone requests 2b bf16"
# shellcheck disable=SC2086  # LONE_FLAGS: several flags
lone=$out/lone-2b-bf16${LONE_SUFFIX:-}  # LONE_SUFFIX: another run beside the first (e.g. -before)
timeout "${LONE_TIMEOUT:-420}" $PY ops/bench/lone.py --shape 2b --requests "${LONE_REQUESTS:-1000}" \
  --compile-cache "$cache" --out "$lone" ${LONE_FLAGS:-} >"$lone.log" 2>&1
echo "exit $?"; grep -E "^(worker ready|SUMMARY)" "$lone.log" || tail -n 30 "$lone.log"
pkill -f "lone.py --worker" 2>/dev/null; sleep 1; }

for run in bf16 fp8 fp8-late bf16-warm bf16-2 bf16-3 bf16-det; do
  want "e2e-$run" || continue
  stage "end to end 2b $run"
  # The reference engine's figure does not depend on the fast engine's dtype: timed once, in the FP8 stage.
  case $run in fp8) flag=--fp8 ;; fp8-late) flag="--fp8 --fp8-layers late --no-reference" ;;
    bf16-det) flag="--deterministic --no-reference" ;; *) flag=--no-reference ;; esac
  timeout "${E2E_TIMEOUT:-420}" $PY ops/bench/end_to_end.py --shape 2b $flag --requests "${E2E_REQUESTS:-3000}" \
    --loads "${E2E_LOADS:-0.5}" --latency-seconds "${E2E_LATENCY_SECONDS:-10}" --compile-cache "$cache" --out "$out/e2e-2b-$run" \
    ${E2E_EPILOGUES:+--epilogues "$E2E_EPILOGUES"} >"$out/e2e-2b-$run.log" 2>&1
  echo "exit $?"; grep -E "^(worker ready|SUMMARY)" "$out/e2e-2b-$run.log" || tail -n 30 "$out/e2e-2b-$run.log"
  pkill -f "end_to_end.py --worker" 2>/dev/null; sleep 1  # a worker left by a killed stage holds the GPU
done

want scaling && { stage "scaling over the GPUs, 2b bf16"
gpus=$(nvidia-smi -L 2>/dev/null | wc -l); counts=1
for k in 2 4 8; do [ "$k" -le "$gpus" ] && counts="$counts,$k"; done
timeout "${SCALING_TIMEOUT:-1800}" $PY ops/bench/scaling.py --gpus "$counts" --shape 2b --compile-cache "$cache" \
  --out "$out/scaling" >"$out/scaling.log" 2>&1
echo "exit $?"; grep -E "^(SUMMARY|[|])" "$out/scaling.log" || tail -n 30 "$out/scaling.log"; }

want priority && for number in $(seq "${PRIORITY_WORKERS:-3}"); do
  name=priority-2b-bf16$([ "$number" = 1 ] || echo "-$number")
  stage "priority lanes 2b bf16, fresh worker $number"
  timeout "${PRIORITY_TIMEOUT:-420}" $PY ops/bench/priority.py --shape 2b --requests "${PRIORITY_REQUESTS:-6000}" \
    --repeats "${PRIORITY_REPEATS:-1}" --compile-cache "$cache" --out "$out/$name" >"$out/$name.log" 2>&1
  echo "exit $?"; grep -E "^(worker ready|SUMMARY)" "$out/$name.log" || tail -n 30 "$out/$name.log"
  pkill -f "priority.py --worker" 2>/dev/null; sleep 1
done

want fidelity && { stage "fidelity at the 2b shape"
timeout "${FIDELITY_TIMEOUT:-240}" $PY ops/bench/fidelity.py --shape 2b --out "$out/fidelity" \
  >"$out/fidelity.log" 2>&1
echo "exit $?"; tail -n 12 "$out/fidelity.log"; }

for run in invariance invariance-det; do
  want $run || continue
  stage "$run: alone against mixed, 2b bf16"
  flag=; [ $run = invariance-det ] && flag=--deterministic
  timeout "${INVARIANCE_TIMEOUT:-420}" $PY ops/bench/invariance.py --shape 2b $flag --requests "${INVARIANCE_REQUESTS:-3000}" \
    --compile-cache "$cache" --out "$out/$run-2b-bf16" ${E2E_EPILOGUES:+--epilogues "$E2E_EPILOGUES"} \
    >"$out/$run-2b-bf16.log" 2>&1
  echo "exit $?"; grep -E "^SUMMARY" "$out/$run-2b-bf16.log" || tail -n 30 "$out/$run-2b-bf16.log"
  pkill -f "invariance.py --worker" 2>/dev/null; sleep 1
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
