#!/usr/bin/env bash
# One device call for the grouped GEMM (issue 8): build, the grouped tests and compute-sanitizer
# (memcheck, racecheck, synccheck) on the 128-row kernel tests (scripts/gpu_session.sh), then
# bench_cuda_grouped with the given arguments, then optionally Nsight Compute on the first grouped
# GEMM of one configuration for each tile width. At most 8 files come back from $OUT: the summary,
# the bench log and CSV, the ncu digest, and everything else in logs.tgz.
#   [GROUPED_SAN=GTEST_FILTER|""] [GROUPED_NCU="BENCH ARGS"] scripts/grouped_gpu_run.sh [BENCH ARGS]
# GROUPED_SAN: the sanitizer's test filter ("" = no sanitizer; default: the kernel tests of the
# 128-row kernel, both tile widths). GROUPED_NCU: bench arguments of the profiled run (e.g.
# "--shape deepseek_v3_tp2 --rpe 512 --gemm gemm1 --layouts contig"); each tile width of
# GROUPED_NCU_TILES (default "128 256") is profiled once. GROUPED_FUSE="SHAPES" (e.g.
# "deepseek_v3_tp2,deepseek_v3_ep8"): the grouped tests again with FP8MOE_GROUPED_FUSE_ACT=1 (the
# layer tests then run GEMM1 with the fused activation + quantisation epilogue), and the full layer
# of those shapes at 2048 rows per expert without and with the fusion (fuse.log).
set -uo pipefail
cd "$(dirname "$0")/.."
FINAL=${OUT:-$PWD/gpu_out}
mkdir -p "$FINAL"
W=/tmp/grouped_run
rm -rf "$W"
mkdir -p "$W"
SAN=${GROUPED_SAN-'TileM/CudaGroupedGemm.*/tile_m128*'}
args=(--no-bench --tests-filter Grouped --grouped-bench-args "${*:--}")
if [ -n "$SAN" ]; then args+=(--san-filter "$SAN"); else args+=(--no-sanitize); fi
OUT=$W bash scripts/gpu_session.sh "${args[@]}" >"$W/session.log" 2>&1
sed -n '/== summary/,$p' "$W/session.log"
grep -q 'build: rc=0' "$W/summary.txt" || tail -40 "$W/build.log"
zgrep -hE '^\[  FAILED  \]|Failure$|want 0x' "$W/tests.log.gz" 2>/dev/null | head -20
B=build-gpu/bench/bench_cuda_grouped
if [ -n "${GROUPED_NCU:-}" ] && [ -x "$B" ]; then
  # the counters that exist on this chip, among the ones wanted
  WANT='sm__pipe_tensor_op_gmma_cycles_active sm__pipe_tensor_cycles_active
    sm__inst_executed_pipe_tensor_op_gmma lts__t_bytes lts__t_sectors_op_read
    lts__t_sectors_srcunit_tex_op_read sm__throughput lts__throughput'
  HAVE=$(timeout 60 ncu --query-metrics 2>/dev/null | awk '{print $1}')
  MET=""
  for m in $WANT; do
    echo "$HAVE" | grep -qx "$m" || continue
    case $m in
      *cycles_active | *throughput) MET+="$m.avg.pct_of_peak_sustained_elapsed," ;;
      *) MET+="$m.sum,$m.sum.per_second," ;;
    esac
  done
  MET=${MET%,}
  for tn in ${GROUPED_NCU_TILES:-128 256}; do
    # shellcheck disable=SC2086
    timeout 150 ncu --clock-control none -k regex:grouped_gemm -c 1 --section SpeedOfLight \
      --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
      ${MET:+--metrics $MET} --print-details all "$B" --no-ceilings --no-layer --tile-n "$tn" \
      $GROUPED_NCU >"$W/ncu_n$tn.log" 2>&1
    echo "ncu tile_n $tn: rc=$?" | tee -a "$W/ncu.txt"
    grep -E 'grouped_gemm|Duration|Throughput|L2 Hit|Mem Busy|Max Bandwidth|Mem Pipes|Issue|SM Busy|Executed Ipc|lts__|sm__|ERROR|==PROF==|==ERROR==' \
      "$W/ncu_n$tn.log" | head -60 >>"$W/ncu.txt"
  done
  cat "$W/ncu.txt"
fi
if [ -n "${GROUPED_FUSE:-}" ] && [ -x "$B" ]; then
  FP8MOE_GROUPED_FUSE_ACT=1 ctest --test-dir build-gpu -j 12 --timeout 300 -R Grouped \
    --output-on-failure >"$W/tests_fuse.log" 2>&1
  echo "tests with FP8MOE_GROUPED_FUSE_ACT=1: rc=$? $(grep -E 'tests passed|tests failed' \
    "$W/tests_fuse.log" | tail -1)" | tee "$W/fuse.log"
  grep -E '^\s+[0-9]+ - .*\(Failed|Timeout' "$W/tests_fuse.log" | head -20 | tee -a "$W/fuse.log"
  for f in 0 1; do
    echo "== layer, FP8MOE_GROUPED_FUSE_ACT=$f" | tee -a "$W/fuse.log"
    FP8MOE_GROUPED_FUSE_ACT=$f timeout 120 "$B" --no-ceilings --shape "$GROUPED_FUSE" --rpe 2048 \
      --gemm none 2>&1 | grep layer | tee -a "$W/fuse.log"
  done
  cp "$W/fuse.log" "$FINAL/"
fi
echo "== grouped bench"
cat "$W/grouped.log" 2>/dev/null
cp "$W/summary.txt" "$W/grouped.log" "$W/grouped.csv" "$FINAL/" 2>/dev/null
[ -f "$W/ncu.txt" ] && cp "$W/ncu.txt" "$FINAL/"
tar czf "$FINAL/logs.tgz" -C "$W" . 2>/dev/null
exit 0
