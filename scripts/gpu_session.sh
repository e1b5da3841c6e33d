#!/usr/bin/env bash
# One GPU session in a single call on the GPU machine: environment check, build for sm_90a with all
# cores, the CUDA tests, a compute-sanitizer subset (memcheck, racecheck, synccheck) and the
# benchmark, with every log under $OUT (or ./gpu_out) and a short summary printed last.
#
#   scripts/gpu_session.sh [--no-tests] [--no-sanitize] [--no-bench] [--bench-args "..."]
#                          [--tests-filter REGEX] [--ncu "BENCH ARGS"] [--bench2-args "..."]
#                          [--grouped-bench-args "..."] [--san-filter GTEST_FILTER]
#                          [--trace "SHAPE ..."] [--stream-bench] [--ncu-source "BENCH ARGS"]
# --grouped-bench-args runs bench_cuda_grouped (the DEEPGEMM-contract grouped GEMM) with these
# arguments (grouped.log, grouped.csv; "-" for none). --san-filter replaces the sanitizer subset.
# --bench2-args runs the benchmark a second time with these arguments (bench2.log, bench2.csv),
# e.g. "--path stream,decode --m 1,8,32" to compare two paths in the same session.
# --stream-bench runs bench_cuda_stream (what a bulk-copy / TMA ring streams per SM; stream.log).
# --trace runs the single path once per shape at M = 1 with FP8MOE_SINGLE_TRACE=1 (trace.log: the
# phase stamps of the second, warm call).
# The device tool brings back at most ~8 files from $OUT: the sanitizer logs end up in one file
# (sanitizers.log) and the build and test logs are gzipped at the end.
# --ncu-source profiles the second launch of the single-path kernel of `bench_cuda_moe --ncu BENCH
# ARGS` (e.g. "--path single --m 1 --shape deepseek_v3_tp8"): warp-state details (ncu_source.log)
# and the per-instruction stall samples of the SASS (ncu_sass.csv.gz, `--page source`).
# --ncu runs Nsight Compute (SpeedOfLight, memory, warp stalls) on the fused-MoE kernels of one
# direct run per configuration of `bench_cuda_moe --ncu BENCH ARGS`, into ncu.log (NCU_SECTIONS
# overrides the sections, e.g. "--section SpeedOfLight" for durations and throughputs only).
#
# Dependencies the machine may lack (gtest, fmt, nlohmann_json, CLI11, hwy, benchmark) are taken
# from a Debian package prefix when one is found at $FP8MOE_DEPS_PREFIX, ../.debs/prefix/usr or
# ./.debs/prefix/usr (see docs/PERFORMANCE.md, "How to run"); CUTLASS headers from $FP8MOE_CUTLASS_INCLUDE or
# ../.deps/python/cutlass_library/source/include.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${OUT:-$ROOT/gpu_out}
mkdir -p "$OUT"
RUN_TESTS=1
RUN_SAN=1
RUN_BENCH=1
BENCH_ARGS=""
NCU_ARGS=""
NCU_SOURCE_ARGS=""
BENCH2_ARGS=""
TESTS_FILTER="Cuda"
GROUPED_ARGS=""
SAN_FILTER_ARG=""
TRACE_SHAPES=""
STREAM_BENCH=0
while [ $# -gt 0 ]; do
  case "$1" in
    --no-tests) RUN_TESTS=0 ;;
    --no-sanitize) RUN_SAN=0 ;;
    --no-bench) RUN_BENCH=0 ;;
    --bench-args) BENCH_ARGS="$2"; shift ;;
    --tests-filter) TESTS_FILTER="$2"; shift ;;
    --ncu) NCU_ARGS="$2"; shift ;;
    --ncu-source) NCU_SOURCE_ARGS="$2"; shift ;;
    --bench2-args) BENCH2_ARGS="$2"; shift ;;
    --grouped-bench-args) GROUPED_ARGS="$2"; shift ;;
    --san-filter) SAN_FILTER_ARG="$2"; shift ;;
    --trace) TRACE_SHAPES="$2"; shift ;;
    --stream-bench) STREAM_BENCH=1 ;;
    *) echo "unknown argument $1"; exit 2 ;;
  esac
  shift
done
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }

# ---- environment ------------------------------------------------------------------------------
{
  echo "== environment"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  nvcc --version | tail -2
  cmake --version | head -1
  ninja --version
  g++ --version | head -1
  nproc
  ls -d /usr/include/gtest /usr/include/fmt /usr/include/nlohmann /usr/include/CLI /usr/include/hwy \
    /usr/include/benchmark 2>&1
  command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer
} >"$OUT/build.log" 2>&1
stamp "environment logged"

PREFIX=${FP8MOE_DEPS_PREFIX:-}
[ -z "$PREFIX" ] && [ -d "$ROOT/../.debs/prefix/usr" ] && PREFIX=$(cd "$ROOT/../.debs/prefix/usr" && pwd)
[ -z "$PREFIX" ] && [ -d "$ROOT/.debs/prefix/usr" ] && PREFIX="$ROOT/.debs/prefix/usr"  # as gpu_ab.sh
CUTLASS=${FP8MOE_CUTLASS_INCLUDE:-}
[ -z "$CUTLASS" ] && [ -d "$ROOT/../.deps/python/cutlass_library/source/include" ] &&
  CUTLASS=$(cd "$ROOT/../.deps/python/cutlass_library/source/include" && pwd)
[ -z "$CUTLASS" ] && [ -d "$ROOT/.deps/python/cutlass_library/source/include" ] &&
  CUTLASS="$ROOT/.deps/python/cutlass_library/source/include"
CMAKE_EXTRA=()
if [ -n "$PREFIX" ]; then
  CMAKE_EXTRA+=("-DCMAKE_PREFIX_PATH=$PREFIX" "-DCMAKE_INCLUDE_PATH=$PREFIX/include")
  export LD_LIBRARY_PATH="$PREFIX/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
fi
[ -n "$CUTLASS" ] && CMAKE_EXTRA+=("-DFP8MOE_CUTLASS_INCLUDE=$CUTLASS")
# g++ 13 (the GPU image) does not pull <cstdint> in through the standard headers as g++ 12 does;
# a few shared headers rely on that, so force it in (host C++ only: nvcc preprocesses .cu twice).
CMAKE_EXTRA+=("-DCMAKE_CXX_FLAGS=-include cstdint")
[ -x /usr/local/cuda/bin/nvcc ] && export PATH=/usr/local/cuda/bin:$PATH

# ---- build ------------------------------------------------------------------------------------
BUILD=$ROOT/build-gpu
stamp "configure"
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFP8MOE_WITH_CUDA=ON \
  "${CMAKE_EXTRA[@]}" >>"$OUT/build.log" 2>&1
CFG=$?
stamp "build"
if [ $CFG -eq 0 ]; then
  cmake --build "$BUILD" -j "$(nproc)" --target fp8moe_cuda_tests bench_cuda_moe \
    $([ -f bench/bench_cuda_grouped.cu ] && echo bench_cuda_grouped) \
    $([ -f bench/bench_cuda_stream.cu ] && echo bench_cuda_stream) >>"$OUT/build.log" 2>&1
  BUILD_RC=$?
else
  BUILD_RC=$CFG
fi
note "build: rc=$BUILD_RC ($(( $(date +%s) - T0 ))s)"
if [ $BUILD_RC -ne 0 ]; then
  tail -40 "$OUT/build.log"
  cat "$SUMMARY"
  exit 1
fi
TESTS=$BUILD/tests/fp8moe_cuda_tests
BENCH=$BUILD/bench/bench_cuda_moe

# ---- tests ------------------------------------------------------------------------------------
if [ $RUN_TESTS -eq 1 ]; then
  stamp "tests"
  ctest --test-dir "$BUILD" -j 12 --timeout 420 -R "$TESTS_FILTER" --output-on-failure \
    >"$OUT/tests.log" 2>&1
  TEST_RC=$?
  note "tests: rc=$TEST_RC; $(grep -E 'tests passed|tests failed' "$OUT/tests.log" | tail -1)"
  grep -E '^\s+[0-9]+ - .*\((Failed|Timeout|SEGFAULT|Subprocess)' "$OUT/tests.log" | head -30 |
    tee -a "$SUMMARY"
fi

# ---- compute-sanitizer subset -------------------------------------------------------------------
if [ $RUN_SAN -eq 1 ]; then
  SAN_FILTER='CudaStreamPath.ExpertMapPaddedSlotsAndEmptyExperts:Cases/CudaExact.BitwiseOnEveryPath/block128_M5:Cases/CudaExact.BitwiseOnEveryPath/expert_parallel:Cases/CudaExact.BitwiseOnEveryPath/per_tensor_static:CudaExactBatched.MaskedFormatEntryPoint'
  [ -n "$SAN_FILTER_ARG" ] && SAN_FILTER="$SAN_FILTER_ARG"
  for tool in memcheck racecheck synccheck; do
    stamp "compute-sanitizer $tool"
    timeout 300 compute-sanitizer --tool $tool --error-exitcode 9 "$TESTS" \
      --gtest_filter="$SAN_FILTER" >"$OUT/sanitizer.tmp" 2>&1
    rc=$?
    note "sanitizer $tool: rc=$rc; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED' \
      "$OUT/sanitizer.tmp" | tr '\n' ' ' | cut -c1-200)"
    { echo "==== $tool (rc=$rc)"; cat "$OUT/sanitizer.tmp"; } >>"$OUT/sanitizers.log"
    rm -f "$OUT/sanitizer.tmp"
  done
fi

# ---- Nsight Compute ------------------------------------------------------------------------------
if [ -n "$NCU_ARGS" ]; then
  stamp "ncu"
  # shellcheck disable=SC2086
  timeout 300 ncu --clock-control none -k 'regex:moe_single_kernel|moe_decode_kernel|moe_gemm_wgmma_kernel|moe_gemm_mma_kernel|moe_stream|moe_route|grouped_gemm' \
    ${NCU_SECTIONS:---section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section LaunchStats --section Occupancy --section SourceCounters} --print-details all \
    "$BENCH" --ncu $NCU_ARGS >"$OUT/ncu.log" 2>&1
  note "ncu: rc=$?"
fi
if [ -n "$NCU_SOURCE_ARGS" ]; then
  stamp "ncu source"
  # shellcheck disable=SC2086
  timeout 120 ncu --clock-control none -k regex:moe_single_kernel --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SourceCounters --print-details all \
    "$BENCH" --ncu $NCU_SOURCE_ARGS >"$OUT/ncu_source.log" 2>&1
  note "ncu source (details): rc=$?"
  # shellcheck disable=SC2086
  timeout 120 ncu --clock-control none -k regex:moe_single_kernel --launch-skip 1 --launch-count 1 \
    --section SourceCounters --page source --print-source sass --csv \
    "$BENCH" --ncu $NCU_SOURCE_ARGS >"$OUT/ncu_sass.csv" 2>&1
  note "ncu source (sass): rc=$?, $(wc -l <"$OUT/ncu_sass.csv") lines"
  python3 scripts/ncu_sass_summary.py "$OUT/ncu_sass.csv" --top 30 >"$OUT/ncu_sass_summary.txt" 2>&1
  gzip -f "$OUT/ncu_sass.csv"
fi

# ---- benchmark --------------------------------------------------------------------------------
if [ $RUN_BENCH -eq 1 ]; then
  stamp "benchmark"
  # shellcheck disable=SC2086
  "$BENCH" --csv "$OUT/bench.csv" $BENCH_ARGS >"$OUT/bench.log" 2>&1
  note "bench: rc=$?"
  if [ -n "$BENCH2_ARGS" ]; then
    # shellcheck disable=SC2086
    "$BENCH" --csv "$OUT/bench2.csv" $BENCH2_ARGS >"$OUT/bench2.log" 2>&1
    note "bench2: rc=$?"
  fi
fi

if [ -n "$GROUPED_ARGS" ]; then
  stamp "grouped benchmark"
  [ "$GROUPED_ARGS" = "-" ] && GROUPED_ARGS=""
  # shellcheck disable=SC2086
  "$BUILD/bench/bench_cuda_grouped" --csv "$OUT/grouped.csv" $GROUPED_ARGS >"$OUT/grouped.log" 2>&1
  note "grouped bench: rc=$?"
fi

if [ $STREAM_BENCH -eq 1 ]; then
  stamp "stream benchmark"
  timeout 120 "$BUILD/bench/bench_cuda_stream" >"$OUT/stream.log" 2>&1
  note "stream bench: rc=$?"
fi

if [ -n "$TRACE_SHAPES" ]; then
  stamp "single-path traces"
  for sh in $TRACE_SHAPES; do
    FP8MOE_SINGLE_TRACE=1 timeout 60 "$BENCH" --ncu --path single --m 1 --shape "$sh" 2>&1 |
      grep -A1 "single trace" | tail -2 >>"$OUT/trace.log"
  done
  note "traces: $(grep -c 'single trace' "$OUT/trace.log" 2>/dev/null || echo 0)"
fi

for f in build.log tests.log; do [ -f "$OUT/$f" ] && gzip -f "$OUT/$f"; done
stamp "done"
echo "=================== summary ==================="
cat "$SUMMARY"
[ -f "$OUT/bench.log" ] && sed -n '/== summary/,$p' "$OUT/bench.log" && grep -E '^device|^ceilings' "$OUT/bench.log"
[ -f "$OUT/bench2.log" ] && echo "== bench2" && sed -n '/== summary/,$p' "$OUT/bench2.log"
exit 0
