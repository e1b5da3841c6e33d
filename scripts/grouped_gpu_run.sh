#!/usr/bin/env bash
# One short device call for the grouped GEMM (issue 8): build (scripts/gpu_session.sh), the grouped
# tests in 4 parallel shards with the opt-in variants on (FP8MOE_GROUPED_SWAP=1,
# FP8MOE_GROUPED_MCAST=1; the kernel tests force every m-block and both cluster modes themselves),
# compute-sanitizer memcheck on the kernel tests, and bench_cuda_grouped with the given arguments
# (clusters on), then one shape with clusters off. Logs under $OUT.
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
export FP8MOE_GROUPED_SWAP=1 FP8MOE_GROUPED_MCAST=1
for i in 0 1 2 3; do
  GTEST_TOTAL_SHARDS=4 GTEST_SHARD_INDEX=$i timeout 70 "$T" --gtest_filter='*Grouped*' \
    >/tmp/tests$i.log 2>&1 &
done
wait
cat /tmp/tests[0-3].log >"$OUT/tests.log"
echo "tests: $(grep -hE '^\[  PASSED  \]' /tmp/tests[0-3].log | tr '\n' ' ')"
grep -hE '^\[  FAILED  \]|Failure|want 0x|dense w2|thinned w2|worst' "$OUT/tests.log" | head -30
timeout 30 compute-sanitizer --tool memcheck "$T" \
  --gtest_filter='TileM/CudaGroupedGemm.*:CudaGroupedMasked.Exact*' >"$OUT/sanitizer.log" 2>&1
echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY|PASSED|FAILED' "$OUT/sanitizer.log" | tr '\n' ' ')"
timeout 60 "$B" --csv "$OUT/grouped.csv" --mcast 1 "$@" >"$OUT/grouped.log" 2>&1
echo "bench rc=$?"
timeout 15 "$B" --shape deepseek_v3_tp2 --rpe 2048 --no-layer --mcast 0 >"$OUT/nomcast.log" 2>&1
echo "bench (no clusters) rc=$?"
