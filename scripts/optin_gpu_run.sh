#!/usr/bin/env bash
# One device call for opt-in variants that wait for the card: build and the CUDA tests once
# (scripts/gpu_session.sh, compute-sanitizer on SAN_FILTER), then for every variant of
# OPTIN_TEST_VARIANTS the tests matching OPTIN_TESTS again with that environment (plus memcheck and
# racecheck on OPTIN_SAN with it), then `bench_cuda_moe BENCH ARGS` without and with each variant of
# OPTIN_VARIANTS in the same session. A variant may set several variables: "A=1,B=1". Both lists
# are empty by default: then only the plain tests and benchmarks run. Logs in $OUT (or
# ./gpu_out): summary.txt, tests_*.log, san_*.log, bench_<n>.log; the summary is printed last.
# Session 27's opt-ins were measured with it in session 28 (docs/PERFORMANCE.md, grouped run 12):
# correct, not faster, deleted in session 29; none waits now.
#
#   [OPTIN_VARIANTS="A=1 B=1,C=1 ..."] [OPTIN_TEST_VARIANTS="A=1,B=1,C=1 ..."]
#   [OPTIN_TESTS=REGEX] [SAN_FILTER=GTEST_FILTER] [OPTIN_SAN=GTEST_FILTER]
#   [OPTIN_BENCH2="BENCH ARGS"] (a last plain benchmark; default "--path stream,grouped --m 1":
#    which path single tokens should take now; "" for none)
#   scripts/optin_gpu_run.sh [BENCH ARGS, default "--m 1,8,32"]
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
FINAL=${OUT:-$PWD/gpu_out}
mkdir -p "$FINAL"
VARIANTS=${OPTIN_VARIANTS:-}
TEST_VARIANTS=${OPTIN_TEST_VARIANTS:-}
TESTS_RE=${OPTIN_TESTS:-"Cuda|Grouped|EpLayer"}
SAN=${SAN_FILTER:-'TileM/CudaGroupedGemm.*/tile_m16:TileM/CudaGroupedGemm.*/tile_m64:CudaRouting.*'}
OSAN=${OPTIN_SAN:-'Cases/CudaGroupedExact.*/M33:Cases/CudaGroupedExact.*/ep4_rank1:Cases/CudaGroupedExact.*/router_weight_on_input'}
BENCH_ARGS=${*:-"--m 1,8,32"}
S=$FINAL/summary.txt

OUT=$FINAL bash scripts/gpu_session.sh --no-bench --tests-filter "$TESTS_RE" --san-filter "$SAN" \
  >"$FINAL/session.log" 2>&1
grep -q 'build: rc=0' "$S" || {
  tail -40 "$FINAL/build.log"
  cat "$S"
  exit 1
}
T=build-gpu/tests/fp8moe_cuda_tests
B=build-gpu/bench/bench_cuda_moe

for v in $TEST_VARIANTS; do
  IFS=, read -r -a envs <<<"$v"
  env "${envs[@]}" ctest --test-dir build-gpu -j 12 --timeout 300 -R "$TESTS_RE" \
    --output-on-failure >"$FINAL/tests_${v//[=,]/_}.log" 2>&1
  echo "tests with $v: rc=$? $(grep -E 'tests passed|tests failed' \
    "$FINAL/tests_${v//[=,]/_}.log" | tail -1)" | tee -a "$S"
  grep -E '^\s+[0-9]+ - .*\((Failed|Timeout|SEGFAULT|Subprocess)' \
    "$FINAL/tests_${v//[=,]/_}.log" | head -20 | tee -a "$S"
  for tool in memcheck racecheck; do
    env "${envs[@]}" timeout 240 compute-sanitizer --tool $tool --error-exitcode 9 "$T" \
      --gtest_filter="$OSAN" >"$FINAL/san_${tool}_${v//[=,]/_}.log" 2>&1
    echo "  $tool with $v: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED' \
      "$FINAL/san_${tool}_${v//[=,]/_}.log" | tr '\n' ' ' | cut -c1-160)" | tee -a "$S"
  done
done

n=0
# shellcheck disable=SC2086
timeout 200 "$B" $BENCH_ARGS >"$FINAL/bench_0.log" 2>&1
echo "== bench (no opt-in)" >>"$S"
sed -n '/== summary/,$p' "$FINAL/bench_0.log" >>"$S"
for v in $VARIANTS; do
  n=$((n + 1))
  IFS=, read -r -a envs <<<"$v"
  # shellcheck disable=SC2086
  env "${envs[@]}" timeout 200 "$B" $BENCH_ARGS >"$FINAL/bench_$n.log" 2>&1
  echo "== bench with $v" >>"$S"
  sed -n '/== summary/,$p' "$FINAL/bench_$n.log" | tail -n +3 >>"$S"
done
# assigned first, then expanded unquoted so that its words are separate arguments
BENCH2=${OPTIN_BENCH2-"--path stream,grouped --m 1"}
if [ -n "$BENCH2" ]; then
  # shellcheck disable=SC2086
  timeout 120 "$B" $BENCH2 >"$FINAL/bench_paths.log" 2>&1
  echo "== bench $BENCH2 (no opt-in)" >>"$S"
  sed -n '/== summary/,$p' "$FINAL/bench_paths.log" | tail -n +3 >>"$S"
fi
cat "$S"
