#!/usr/bin/env bash
# make demo: the main job on the CPU, in well under two minutes on a 2-core machine.
#   1. the bundled example checkpoint (a small Qwen3-MoE-shaped FP8 model), written if missing;
#   2. the plan for it at TP 1 on this machine, and at TP 4 on a simulated H200, where 640 / 4 = 160
#      rows per rank are not whole 128-blocks, so the block scales are refined to 32x32 at load
#      and only Triton takes them;
#   3. one checked forward on the CPU (the oracle's kernel, or the float64 reference when the
#      oracle's choice has no implementation on this machine), and the four TP 4 ranks summed
#      against the unsharded layer;
#   4. a summary.
# Usage: scripts/demo.sh [BUILD_DIR]   (make demo builds BUILD_DIR/fp8moe first)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
BIN=$BUILD/fp8moe
EX=examples/qwen3-moe-tiny
TOKENS=32
LOG=$(mktemp -d)
trap 'rm -rf "$LOG"' EXIT
start=$(date +%s)

if [ ! -x "$BIN" ]; then
  echo "demo: $BIN is missing; run 'make demo' (it builds it first)" >&2
  exit 2
fi
say() { printf '\n== %s ==\n' "$*"; }
show() { printf '$ %s\n' "$*"; }

say "1/4 the example checkpoint: $EX"
if [ -f "$EX/config.json" ]; then
  echo "already there (delete the folder to write it again)"
else
  if ! "$BIN" make-example --help >/dev/null 2>&1; then
    echo "demo: this fp8moe has no 'make-example' command (the checkpoint room's); cannot write $EX" >&2
    exit 2
  fi
  show fp8moe make-example "$EX"
  "$BIN" make-example "$EX"
fi

say "2/4 the plan at TP 1 on this machine"
show fp8moe run "$EX" --plan-only
tp1_status=0
"$BIN" run "$EX" --plan-only || tp1_status=$?

say "3/4 the plan at TP 4 on an H200 (simulated): 160 rows per rank, so the 128x128 scales are refined"
show fp8moe run "$EX" --tp 4 --plan-only --platform cuda:90
"$BIN" run "$EX" --tp 4 --plan-only --platform cuda:90

say "4/4 one checked forward on the CPU ($TOKENS tokens)"
KERNEL=()
if [ "$tp1_status" -ne 0 ]; then
  echo "The oracle's choice has no implementation on this machine (see the plan above), so the"
  echo "demo runs fp8moe's float64 reference instead: --kernel ref."
  KERNEL=(--kernel ref)
fi
show fp8moe run "$EX" --tokens "$TOKENS" --check --brief "${KERNEL[@]}"
run_status=0
"$BIN" run "$EX" --tokens "$TOKENS" --check --brief "${KERNEL[@]}" | tee "$LOG/tp1.txt" \
  || run_status=$?
echo
show fp8moe run "$EX" --tp 4 --rank all --tokens "$TOKENS" --check --brief --kernel ref --reps 1
tp4_status=0
"$BIN" run "$EX" --tp 4 --rank all --tokens "$TOKENS" --check --brief --kernel ref --reps 1 \
  | tee "$LOG/tp4.txt" || tp4_status=$?

say "summary"
echo "TP 1        $(sed -n 's/^result  //p' "$LOG/tp1.txt" | head -1)"
echo "TP 4        $(sed -n 's/^result  //p' "$LOG/tp4.txt" | head -1)"
elapsed=$(( $(date +%s) - start ))
if [ "$run_status" -eq 0 ] && [ "$tp4_status" -eq 0 ]; then
  echo "result      PASS (the demo ran in ${elapsed} s)"
else
  echo "result      FAIL (TP 1 run exit $run_status, TP 4 run exit $tp4_status)"
  exit 1
fi
