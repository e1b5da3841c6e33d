#!/usr/bin/env bash
# Per-kernel time and DRAM bytes of one layer call, for each shape and M (Nsight Compute on
# `bench_cuda_moe --ncu`, which runs every configuration twice; the second run is reported).
# Needs a build in build-gpu (scripts/gpu_session.sh). Output: one table per shape on stdout and
# ncu_<shape>.csv in $OUT (or ./gpu_out). Extra environment (e.g. FP8MOE_GROUPED_TILE_M=128) applies.
#   scripts/ncu_chain.sh "deepseek_v3_tp8 deepseek_v3_tp2" 1,8,32
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUTDIR=${OUT:-$PWD/gpu_out}
mkdir -p "$OUTDIR"
SHAPES=${1:-deepseek_v3_tp8}
MS=${2:-1,8,32}
B=build-gpu/bench/bench_cuda_moe
[ -x "$B" ] || {
  echo "ncu_chain: $B not built (run scripts/gpu_session.sh first)"
  exit 1
}
for s in $SHAPES; do
  timeout 150 ncu --clock-control none --print-units base --csv \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum "$B" --ncu --shape "$s" --m "$MS" \
    >"$OUTDIR/ncu_$s.csv" 2>"$OUTDIR/ncu_$s.err"
  echo "== $s (M $MS): rc=$?"
  python3 - "$OUTDIR/ncu_$s.csv" <<'EOF'
import csv, re, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) >= 15 and r[0].isdigit()]
kern = {}
for r in rows:
    k = kern.setdefault(int(r[0]), {"name": r[4], "grid": r[8]})
    k[r[12]] = float(r[14].replace(",", ""))
skip = ("fill", "copy_kernel", "read_kernel", "cublas", "nvjet", "sm90_xmma", "init")
seq = [k for _, k in sorted(kern.items()) if not any(x in k["name"] for x in skip)]
# every kernel of both runs of each configuration, in launch order
for k in seq:
    name = re.sub(r"\(.*", "", k["name"]).replace("fp8moe::", "").replace("cuda::", "")
    name = name.replace("<unnamed>::", "").replace("void ", "")[:52]
    print(f"  {name:52s} grid {k['grid']:>14s} {k.get('gpu__time_duration.sum', 0) / 1e3:8.1f} us"
          f" {k.get('dram__bytes_read.sum', 0) / 1e6:9.2f} MB")
EOF
done
