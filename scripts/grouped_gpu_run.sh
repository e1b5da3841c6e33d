#!/usr/bin/env bash
# One device call for the grouped GEMM (issue 8): build (scripts/gpu_session.sh), the grouped tests
# in 4 parallel shards, compute-sanitizer memcheck/racecheck/synccheck on the kernel tests, and
# bench_cuda_grouped (all shapes, then one shape with clusters off). Logs under $OUT.
#   scripts/grouped_gpu_run.sh [BENCH ARGS...]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
bash scripts/gpu_session.sh --no-tests --no-sanitize --no-bench >/tmp/session.log 2>&1
tail -2 /tmp/session.log
T=build-gpu/tests/fp8moe_cuda_tests
B=build-gpu/bench/bench_cuda_grouped
[ -x "$T" ] || exit 1
for i in 0 1 2 3; do
  GTEST_TOTAL_SHARDS=4 GTEST_SHARD_INDEX=$i timeout 150 "$T" --gtest_filter='*Grouped*' \
    >/tmp/tests$i.log 2>&1 &
done
wait
cat /tmp/tests[0-3].log >"$OUT/tests.log"
echo "tests: $(grep -hE '^\[  PASSED  \]' /tmp/tests[0-3].log | tr '\n' ' ')"
grep -hE '^\[  FAILED  \]|Failure|want 0x|dense w2|thinned w2|worst' "$OUT/tests.log" | head -30
F='TileM/CudaGroupedGemm.*:CudaGroupedMasked.Exact*'
: >"$OUT/sanitizer.log"
for tool in memcheck racecheck synccheck; do
  timeout 45 compute-sanitizer --tool $tool "$T" --gtest_filter="$F" >/tmp/san.log 2>&1
  echo "$tool rc=$? $(grep -E 'SUMMARY|PASSED|FAILED' /tmp/san.log | tr '\n' ' ')" |
    tee -a "$OUT/sanitizer.log"
  tail -30 /tmp/san.log >>"$OUT/sanitizer.log"
done
timeout 220 "$B" --csv "$OUT/grouped.csv" "$@" >"$OUT/grouped.log" 2>&1
echo "bench rc=$?"
FP8MOE_GROUPED_MCAST=0 timeout 40 "$B" --shape deepseek_v3_tp2 --rpe 512,2048 --no-layer \
  >"$OUT/nomcast.log" 2>&1
echo "bench (no clusters) rc=$?"
