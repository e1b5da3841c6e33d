#!/usr/bin/env bash
# make demo: the main job on the CPU. Until the layer exists, the oracle explains a bundled configuration.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
BIN=$BUILD/fp8moe
echo "== fp8moe demo: which FP8 MoE kernel runs Qwen3-30B-A3B-FP8 experts on an H200 at TP4? =="
"$BIN" oracle select --platform cuda:90 --installed all --weight-key kFp8Static128BlockSym \
  --activation-key kFp8Dynamic128Sym --num-experts 128 --topk 8 --hidden 2048 --intermediate 768 --tp 4
