#!/usr/bin/env bash
# make demo: the main job on the CPU. Until the layer exists, the oracle explains a bundled configuration
# and the planner plans the bundled example checkpoint and real models' configs.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
BIN=$BUILD/fp8moe
echo "== fp8moe demo: which FP8 MoE kernel runs Qwen3-30B-A3B-FP8 experts on an H200 at TP4? =="
"$BIN" oracle select --platform cuda:90 --installed all --weight-key kFp8Static128BlockSym \
  --activation-key kFp8Dynamic128Sym --num-experts 128 --topk 8 --hidden 2048 --intermediate 768 --tp 4
echo
echo "== the example checkpoint (examples/qwen3-moe-tiny): planned from its headers, at TP4 on an H200 =="
[ -f examples/qwen3-moe-tiny/config.json ] || "$BIN" make-example examples/qwen3-moe-tiny
"$BIN" plan examples/qwen3-moe-tiny --tp 4 --platform cuda:90
echo
echo "== which TP sizes work for Qwen3-30B-A3B-FP8 on an H200 (auto), and on a B200 with flashinfer_trtllm =="
"$BIN" plan examples/configs/Qwen3-30B-A3B-FP8 --platform cuda:90 --sweep-tp 1,2,4,8,16
"$BIN" plan examples/configs/Qwen3-30B-A3B-FP8 --platform cuda:100 --moe-backend flashinfer_trtllm \
  --sweep-tp 1,2,4,8,16
