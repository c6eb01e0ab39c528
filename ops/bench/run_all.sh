#!/usr/bin/env bash
# Everything the GPU machine measures, most important first, each stage bounded in time so that a slow or
# failing stage cannot starve the next: end to end through Redis (2B bf16, 2B FP8; each also times its engine
# in process and the reference engine), the GPU tests, then the other shapes and mixes in process.
# Usage: ops/bench/run_all.sh OUTDIR [STAGE...]
#   stages: delta-rule lone e2e-bf16 e2e-fp8 e2e-fp8-late e2e-bf16-warm e2e-bf16-2 e2e-bf16-3 e2e-bf16-nondet
#   priority fidelity fidelity-floor invariance invariance-det tests tests-1 tests-2 mixes (default: all but
#   e2e-bf16-2/3, e2e-bf16-nondet, invariance-det, fidelity-floor and the test parts, in that order); machine: only
#   OUTDIR/machine.txt. gate, gate-1, gate-2, gate-3: the gate (issue 48), every target measured at one commit
#   in parts of one device command each (ops/bench/gate.sh; GATE_SMOKE=1 checks its harness on the CPU).
#
# lone is one request at a time, through the client and through the gateway, 2B bf16 (ops/bench/lone.py;
# LONE_FLAGS: more flags for its worker, e.g. the defaults before 1234dca: --buckets 2048,4096,8192,16384
# --max-wait-ms 5). delta-rule is the host and GPU time of the gated delta rule per pack, fla's dispatch
# against FlashQLA called directly; e2e-fp8-late is the shipped FP8 setting, --fp8 --fp8-layers late;
# e2e-bf16-warm, -2 and -3 start a fresh bf16 worker again on the compile caches the earlier stages left (three
# fresh workers: the median is the figure); priority is high requests at 10% of the peak rate over a
# saturating normal backlog, 2B bf16, in PRIORITY_WORKERS fresh workers (default 3; OUTDIR/priority-2b-bf16,
# -2, -3) PRIORITY_REPEATS times each (default 1); fidelity is FP8 and bf16 against an fp32 reference at the
# 2B shape; fidelity-floor is the fast engine's defaults and deterministic mode against the bf16 floor on the
# fidelity set (ops/bench/fidelity_floor.py; FLOOR_REQUESTS, FLOOR_FLAGS); invariance is a held-out set
# answered alone by one worker, then mixed into a backlog by a second, compared bitwise (2B bf16,
# ops/bench/invariance.py), with --no-deterministic; invariance-det the same with --deterministic. Every other
# stage runs the worker's default: deterministic mode where its kernels run (Hopper); e2e-bf16-nondet is
# e2e-bf16's twin with --no-deterministic (deterministic mode's cost: e2e-bf16 against it, on the same
# machine); tests-1 and tests-2 are tests/gpu in two parts that each
# fit one device command (GPU_TESTS_1, then every other module), with the compile cache below. Named only,
# never by default: scaling (2B bf16 through one Redis on 1, 2, 4, 8 of the machine's GPUs, each count up to
# what it has; ops/bench/scaling.py).
#
# E2E_LOADS: the end-to-end latency phases, x the peak (default 0.5; 0.1,0.2,...,1.0 for latency against
# load, which ops/bench/plot.py draws; E2E_NONDET_LOADS: e2e-bf16-nondet's, default the same);
# E2E_LATENCY_SECONDS: each phase's length (default 10); E2E_EPILOGUES: the workers' --epilogues in the
# end-to-end and invariance stages (worker/fast/epilogues.py; default the worker's own: until e7a3f4a the
# benchmarks' workers ran without them unless it was set). BENCH_SHAPE (default 2b; tiny: the CPU harness)
# and BENCH_FLAGS (more flags for every benchmark's worker) apply to lone, the end-to-end, priority and
# invariance stages. BENCH_PROBE=0: no machine.txt (the probe imports torch; ops/bench/gate.sh writes it once
# per part).
# The workers share one compile cache, COMPILE_CACHE (default OUTDIR/compile-cache): the first end-to-end
# stage of a fresh OUTDIR starts cold, the later ones find what it compiled.
# Stage limits in seconds: LONE_TIMEOUT, E2E_TIMEOUT, SCALING_TIMEOUT, PRIORITY_TIMEOUT, FIDELITY_TIMEOUT,
# FLOOR_TIMEOUT, INVARIANCE_TIMEOUT, TEST_TIMEOUT, MIX_TIMEOUT; a stage still running 30 s after its limit is
# killed. A cold machine needs about 4 minutes before the first end-to-end worker is ready (static-shape
# compilation, FlashQLA's kernels); where one command may run only 10 minutes, run the stages in separate
# commands on the same machine with the same OUTDIR.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: run_all.sh OUTDIR [STAGE...]}
shift
stages=${*:-delta-rule lone e2e-bf16 e2e-fp8 e2e-fp8-late e2e-bf16-warm priority fidelity invariance tests mixes}
case $stages in gate*) exec bash ops/bench/gate.sh "$out" $stages ;; esac
want() { [[ " $stages " == *" $1 "* ]]; }
mkdir -p "$out"
shape=${BENCH_SHAPE:-2b}
more=${BENCH_FLAGS:-}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false DQ_GPU_REPORT="$out/gpu-tests.jsonl"
PY=${PYTHON:-python3}
start=$SECONDS
stage() { echo "== $1 at $((SECONDS - start)) s"; }

[ "${BENCH_PROBE:-1}" = 1 ] && { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c 'import torch, transformers, fla; print("torch", torch.__version__, "transformers", transformers.__version__, "fla", fla.__version__)'
  $PY -c 'import flash_qla; print("flash_qla", flash_qla.__version__)' 2>&1 | tail -1
  echo "cpus $(nproc) $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -1)"
  # The host's speed on one core: the end-to-end path is host-bound on a slow one (72aab1e's gate, BENCHMARKS)
  $PY -c 'import json, time; t = time.perf_counter(); [json.loads(json.dumps({"a": list(range(64)), "b": "x" * 64}))
for _ in range(20000)]; print(f"host: 20000 JSON round trips on one core in {time.perf_counter() - t:.3f} s")'
  echo "commit ${COMMIT:-$(git log --oneline -1 2>/dev/null)}"; } >"$out/machine.txt" 2>&1 &&
  cat "$out/machine.txt"

want delta-rule && { stage "delta rule per pack"
timeout -k 30 "${DELTA_TIMEOUT:-120}" $PY ops/bench/delta_rule.py --out "$out" >"$out/delta_rule.log" 2>&1
echo "exit $?"; tail -n 12 "$out/delta_rule.log"; }

cache=${COMPILE_CACHE:-$out/compile-cache}
want lone && { stage "lone requests $shape bf16"
# shellcheck disable=SC2086  # LONE_FLAGS: several flags
lone=$out/lone-$shape-bf16${LONE_SUFFIX:-}  # LONE_SUFFIX: another run beside the first (e.g. -before)
timeout -k 30 "${LONE_TIMEOUT:-420}" $PY ops/bench/lone.py --shape "$shape" --requests "${LONE_REQUESTS:-1000}" \
  --compile-cache "$cache" --out "$lone" ${LONE_FLAGS:-} $more >"$lone.log" 2>&1
echo "exit $?"; grep -E "^(worker ready|SUMMARY)" "$lone.log" || tail -n 30 "$lone.log"
pkill -f "lone.py --worker" 2>/dev/null; sleep 1; }

for run in bf16 fp8 fp8-late bf16-warm bf16-2 bf16-3 bf16-nondet; do
  want "e2e-$run" || continue
  stage "end to end $shape $run"
  # The reference engine's figure does not depend on the fast engine's dtype: timed once, in the FP8 stage.
  case $run in fp8) flag=--fp8 ;; fp8-late) flag="--fp8 --fp8-layers late --no-reference" ;;
    bf16-nondet) flag="--no-deterministic --no-reference" ;; *) flag=--no-reference ;; esac
  [ "$run" = bf16-nondet ] && loads=${E2E_NONDET_LOADS:-${E2E_LOADS:-0.5}} || loads=${E2E_LOADS:-0.5}
  # the twin's peak once (deterministic mode's cost is reported, not gated); the others the median of three
  [ "$run" = bf16-nondet ] && peaks=${E2E_NONDET_PEAKS:-1} || peaks=${E2E_PEAKS:-3}
  timeout -k 30 "${E2E_TIMEOUT:-420}" $PY ops/bench/end_to_end.py --shape "$shape" $flag --peaks "$peaks" \
    --requests "${E2E_REQUESTS:-3000}" --loads "$loads" --latency-seconds "${E2E_LATENCY_SECONDS:-10}" \
    --compile-cache "$cache" --out "$out/e2e-$shape-$run" ${E2E_EPILOGUES:+--epilogues "$E2E_EPILOGUES"} $more \
    >"$out/e2e-$shape-$run.log" 2>&1
  echo "exit $?"; grep -E "^(worker ready|SUMMARY)" "$out/e2e-$shape-$run.log" || tail -n 30 "$out/e2e-$shape-$run.log"
  pkill -f "end_to_end.py --worker" 2>/dev/null; sleep 1  # a worker left by a killed stage holds the GPU
done

want scaling && { stage "scaling over the GPUs, 2b bf16"
gpus=$(nvidia-smi -L 2>/dev/null | wc -l); counts=1
for k in 2 4 8; do [ "$k" -le "$gpus" ] && counts="$counts,$k"; done
timeout -k 30 "${SCALING_TIMEOUT:-1800}" $PY ops/bench/scaling.py --gpus "$counts" --shape 2b --compile-cache "$cache" \
  --out "$out/scaling" >"$out/scaling.log" 2>&1
echo "exit $?"; grep -E "^(SUMMARY|[|])" "$out/scaling.log" || tail -n 30 "$out/scaling.log"; }

want priority && for number in $(seq "${PRIORITY_WORKERS:-3}"); do
  name=priority-$shape-bf16$([ "$number" = 1 ] || echo "-$number")
  stage "priority lanes $shape bf16, fresh worker $number"
  timeout -k 30 "${PRIORITY_TIMEOUT:-420}" $PY ops/bench/priority.py --shape "$shape" \
    --requests "${PRIORITY_REQUESTS:-6000}" --repeats "${PRIORITY_REPEATS:-1}" --compile-cache "$cache" \
    --out "$out/$name" $more >"$out/$name.log" 2>&1
  echo "exit $?"; grep -E "^(worker ready|SUMMARY)" "$out/$name.log" || tail -n 30 "$out/$name.log"
  pkill -f "priority.py --worker" 2>/dev/null; sleep 1
done

want fidelity && { stage "fidelity at the 2b shape"
timeout -k 30 "${FIDELITY_TIMEOUT:-240}" $PY ops/bench/fidelity.py --shape 2b --out "$out/fidelity" \
  >"$out/fidelity.log" 2>&1
echo "exit $?"; tail -n 12 "$out/fidelity.log"; }

want fidelity-floor && { stage "the defaults against the bf16 floor, fidelity set, $shape"
# shellcheck disable=SC2086  # FLOOR_FLAGS: several flags
timeout -k 30 "${FLOOR_TIMEOUT:-420}" $PY ops/bench/fidelity_floor.py --shape "$shape" \
  --requests "${FLOOR_REQUESTS:-320}" --compile-cache "$cache" --out "$out/fidelity-floor" ${FLOOR_FLAGS:-} \
  >"$out/fidelity-floor.log" 2>&1
echo "exit $?"; grep -E "^(child|reference|SUMMARY)" "$out/fidelity-floor.log" || tail -n 30 "$out/fidelity-floor.log"
pkill -f "fidelity_floor.py .*--child" 2>/dev/null; sleep 1; }

for run in invariance invariance-det; do
  want $run || continue
  stage "$run: alone against mixed, $shape bf16"
  flag=--no-deterministic; [ $run = invariance-det ] && flag=--deterministic
  timeout -k 30 "${INVARIANCE_TIMEOUT:-420}" $PY ops/bench/invariance.py --shape "$shape" $flag \
    --requests "${INVARIANCE_REQUESTS:-3000}" --compile-cache "$cache" --out "$out/$run-$shape-bf16" \
    ${E2E_EPILOGUES:+--epilogues "$E2E_EPILOGUES"} $more >"$out/$run-$shape-bf16.log" 2>&1
  echo "exit $?"; grep -E "^SUMMARY" "$out/$run-$shape-bf16.log" || tail -n 30 "$out/$run-$shape-bf16.log"
  pkill -f "invariance.py --worker" 2>/dev/null; sleep 1
done

want tests && { stage "gpu tests"
timeout -k 30 "${TEST_TIMEOUT:-300}" $PY -m pytest -q -s -p no:cacheprovider tests/gpu >"$out/gpu-tests.log" 2>&1
echo "exit $?"; grep -E "passed|failed|RESULT" "$out/gpu-tests.log" | tail -n 30; }

# tests/gpu in two parts of one device command each, balanced from earlier runs' logs (docs/TESTING.md): the
# bitwise processes (about 250 s, each compiling cold in a cache of its own by design), the kernels and the
# fused kernels; then every other module. They share the benchmarks' compile cache (the 2B shape's kernels
# for the tests at that shape). Per-test seconds land in OUTDIR/tests-N.xml for the next balancing.
GPU_TESTS_1=${GPU_TESTS_1:-tests/gpu/test_bitwise.py tests/gpu/test_kernels.py tests/gpu/test_fused.py tests/gpu/test_defaults_fidelity.py}
for part in tests-1 tests-2; do
  want $part || continue
  stage "gpu tests, $part"
  # shellcheck disable=SC2086  # GPU_TESTS_1: several paths
  chosen=$GPU_TESTS_1
  [ $part = tests-2 ] && chosen="tests/gpu $(printf -- '--ignore=%s ' $GPU_TESTS_1)"
  # shellcheck disable=SC2086
  ( export TORCHINDUCTOR_CACHE_DIR=$cache/inductor TRITON_CACHE_DIR=$cache/triton \
      TILELANG_CACHE_DIR=$cache/tilelang
    timeout -k 30 "${TEST_TIMEOUT:-540}" $PY -m pytest -q -s -rs -p no:cacheprovider --durations=0 \
      --junitxml="$out/$part.xml" $chosen ) >"$out/$part.log" 2>&1
  echo "exit $?"; grep -E "passed|failed|error|SKIPPED|RESULT" "$out/$part.log" | tail -n 40
done

want mixes && { stage "other shapes and mixes, in process"
timeout -k 30 "${MIX_TIMEOUT:-240}" $PY ops/bench/fast_path.py \
  --runs 0.8b:standard:bf16,4b:standard:bf16,2b:long-tail:bf16,2b:vision:bf16 --deadline-s $(( ${MIX_TIMEOUT:-240} - 30 )) \
  --out "$out/mixes" >"$out/mixes.log" 2>&1
echo "exit $?"; tail -n 20 "$out/mixes.log"; }
stage "done"
