#!/usr/bin/env bash
# Same-machine A/B of the CUDA fused MoE benchmark on the GPU machine: the working tree ("new")
# against a base tree ("base") that differs in a few files, built side by side, then
# `bench_cuda_moe` of each, alternating for several rounds (medians per round in ab.log).
# Call-to-call spread on the device is ~10% (docs/PERFORMANCE.md run 14), so a change is judged
# only against its base in the same call.
#
# Here, before the device call:   scripts/gpu_ab.sh --prepare BASE_REF
#   writes the base versions of every file under src/ that differs from BASE_REF into .ab_base/
#   (untracked, so the device tool copies it; delete it after the call).
# On the device, after gpu_session.sh built the new tree (build-gpu):
#   scripts/gpu_ab.sh --run [ROUNDS] ["BENCH ARGS"]   (default 3, "--path auto --m 1,2,4,8,32")
#   AB_BENCH=grouped: bench_cuda_grouped instead (GEMM-only rows; default args "--no-ceilings
#   --no-layer --shape deepseek_v3_tp2,deepseek_v3_tp8 --rpe 16,64,512,2048 --layouts
#   contig,contig_s"), summarised per (shape_gemm, rows per expert, layout).
# One build, two environments (no base tree): after gpu_session.sh built build-gpu,
#   scripts/gpu_ab.sh --run-env ROUNDS "BASE VARS" "NEW VARS" ["BENCH ARGS"]
#   e.g. --run-env 3 "FP8MOE_GROUPED_EPI=sync" "" "--path auto --m 2048,8192"
#   ("" = the defaults; VARS are NAME=VALUE words put in the benchmark's environment), same
#   alternating order, same ab.log / ab_summary.txt (AB_BENCH=grouped as above).
# One build, two argument lists (e.g. the batch-invariant mode against auto):
#   scripts/gpu_ab.sh --run-args ROUNDS "BASE ARGS" "NEW ARGS"
#   e.g. --run-args 2 "--path auto --m 1,8,32" "--path auto --m 1,8,32 --batch-invariant"
# Environment as for gpu_session.sh (FP8MOE_DEPS_PREFIX, FP8MOE_CUTLASS_INCLUDE); output in $OUT.
# Each invocation starts ab.log afresh: keep a copy (e.g. tee the summary) before the next one.
# (Run 14's call 5 ran these commands inline.)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$(pwd)
case "${1:-}" in
  --prepare)
    base=${2:?base ref}
    rm -rf .ab_base
    for f in $(git diff --name-only "$base" -- src); do
      mkdir -p ".ab_base/$(dirname "$f")"
      if git cat-file -e "$base:$f" 2>/dev/null; then
        git show "$base:$f" >".ab_base/$f"
      else
        echo "$f" >>.ab_base/DELETE  # new in the working tree: absent from the base
      fi
    done
    find .ab_base -type f | sort
    ;;
  --run | --run-env | --run-args)
    mode=$1
    rounds=${2:-3}
    env_base="" env_new="" args_new=""
    # --run-args: $3 (the base arguments, read below as for --run) and $4
    [ "$mode" = --run-args ] && args_new=${4?new arguments}
    if [ "$mode" = --run-env ]; then
      env_base=${3?base variables ("" for none)}
      env_new=${4?new variables ("" for none)}
      shift 2
    fi
    target=bench_cuda_moe
    if [ "${AB_BENCH:-}" = grouped ]; then
      target=bench_cuda_grouped
      args=${3:---no-ceilings --no-layer --shape deepseek_v3_tp2,deepseek_v3_tp8 --rpe 16,64,512,2048 --layouts contig,contig_s}
    else
      args=${3:---path auto --m 1,2,4,8,32}
    fi
    OUT=${OUT:-$ROOT/gpu_out}
    mkdir -p "$OUT"
    # one comparison per log: ab_summary.py pools every round of the file it reads (run 9's call
    # 2 appended three comparisons to one log and the later summaries mixed their rounds)
    X=$OUT/ab.log
    : >"$X"
    [ -n "$args_new" ] || args_new=$args
    if [ "$mode" != --run ]; then
      [ -x build-gpu/bench/$target ] || { echo "no build-gpu/bench/$target (gpu_session.sh first)" | tee -a "$X"; exit 2; }
      echo "base: env $env_base args $args; new: env $env_new args $args_new" | tee -a "$X"
      for r in $(seq 1 "$rounds"); do
        order="base new"
        [ $((r % 2)) = 0 ] && order="new base"
        for v in $order; do
          vars=$env_base a=$args
          [ "$v" = new ] && vars=$env_new a=$args_new
          echo "== $v round $r" >>"$X"
          if [ $target = bench_cuda_grouped ]; then
            # shellcheck disable=SC2086
            timeout 200 env $vars build-gpu/bench/$target $a 2>&1 |
              awk '$2 ~ /^gemm[12]$/ && $4 ~ /^[0-9]+$/ {print $1"_"$2, $4, $3, $5}' >>"$X"
          else
            # shellcheck disable=SC2086
            timeout 120 env $vars build-gpu/bench/$target $a 2>&1 | grep -A80 "== summary" |
              grep -E "single|grouped|stream|wgmma|generic" >>"$X"
          fi
        done
      done
      python3 scripts/ab_summary.py "$X" | tee "$OUT/ab_summary.txt"
      exit 0
    fi
    [ -d .ab_base/src ] || { echo "no .ab_base/src (run --prepare first)" | tee -a "$X"; exit 2; }
    BASE=/tmp/ab_base_tree
    rm -rf "$BASE" && mkdir -p "$BASE"
    tar --exclude=./build --exclude=./build-gpu --exclude=./.deps --exclude=./.debs --exclude=./.git -cf - . |
      tar -xf - -C "$BASE"
    cp -r .ab_base/src "$BASE/"
    if [ -f .ab_base/DELETE ]; then
      while read -r f; do rm -f "$BASE/$f"; done <.ab_base/DELETE
    fi
    ln -s "$ROOT/.deps" "$BASE/.deps"
    ln -s "$ROOT/.debs" "$BASE/.debs"
    export PATH=/usr/local/cuda/bin:$PATH
    PREFIX=${FP8MOE_DEPS_PREFIX:-$ROOT/.debs/prefix/usr}
    CUTLASS=${FP8MOE_CUTLASS_INCLUDE:-$ROOT/.deps/python/cutlass_library/source/include}
    (cd "$BASE" && cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DFP8MOE_WITH_CUDA=ON \
      -DCMAKE_PREFIX_PATH="$PREFIX" -DCMAKE_INCLUDE_PATH="$PREFIX/include" \
      -DFP8MOE_CUTLASS_INCLUDE="$CUTLASS" "-DCMAKE_CXX_FLAGS=-include cstdint" \
      >"$OUT/ab_build.log" 2>&1 &&
      cmake --build build -j "$(nproc)" --target $target >>"$OUT/ab_build.log" 2>&1)
    echo "base build rc=$?" | tee -a "$X"
    for r in $(seq 1 "$rounds"); do
      # odd rounds run the base first, even rounds the new tree first (the card heats and
      # power-caps during a run: a fixed order biases the second binary)
      order="base new"
      [ $((r % 2)) = 0 ] && order="new base"
      for v in $order; do
        if [ $v = base ]; then B=$BASE/build/bench/$target; else B=build-gpu/bench/$target; fi
        echo "== $v round $r" >>"$X"
        if [ $target = bench_cuda_grouped ]; then
          # "shape gemm layout rpe us ...": as "shape_gemm rpe layout us" for ab_summary.py
          # shellcheck disable=SC2086
          timeout 200 "$B" $args 2>&1 | awk '$2 ~ /^gemm[12]$/ && $4 ~ /^[0-9]+$/ {print $1"_"$2, $4, $3, $5}' >>"$X"
        else
          # shellcheck disable=SC2086
          timeout 120 "$B" $args 2>&1 | grep -A80 "== summary" | grep -E "single|grouped|stream|wgmma|generic" >>"$X"
        fi
      done
    done
    python3 scripts/ab_summary.py "$X" | tee "$OUT/ab_summary.txt"
    ;;
  *)
    echo "usage: $0 --prepare BASE_REF | --run [ROUNDS] [\"BENCH ARGS\"] |"
    echo "       $0 --run-env ROUNDS \"BASE VARS\" \"NEW VARS\" [\"BENCH ARGS\"] |"
    echo "       $0 --run-args ROUNDS \"BASE ARGS\" \"NEW ARGS\""
    exit 2
    ;;
esac
