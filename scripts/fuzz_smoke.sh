#!/usr/bin/env bash
# A short, bounded libFuzzer run over the parsers (built with clang, -fsanitize=fuzzer,address), starting
# from the seed corpus in tests/fuzz/corpus. Any crash fails the run.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -d tests/fuzz ] || [ -z "$(ls tests/fuzz/*.cpp 2>/dev/null)" ]; then
  echo "fuzz: no fuzz targets yet"; exit 0
fi
CXX=clang++ CC=clang cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DFP8MOE_FUZZ=ON -DFP8MOE_WITH_CUDA=OFF -DFP8MOE_BUILD_TESTS=OFF -DFP8MOE_BUILD_BENCH=OFF \
  -DFP8MOE_BUILD_TOOL=OFF >/dev/null
cmake --build build-fuzz -j "$(nproc)"
SECONDS_PER_TARGET=${FUZZ_SECONDS:-60}
for bin in build-fuzz/tests/fuzz/fuzz_*; do
  [ -x "$bin" ] || continue
  name=$(basename "$bin")
  corpus=tests/fuzz/corpus/${name#fuzz_}
  work=build-fuzz/corpus-$name
  mkdir -p "$work"
  echo "fuzz: $name for ${SECONDS_PER_TARGET}s"
  "$bin" -max_total_time="$SECONDS_PER_TARGET" -rss_limit_mb=2048 -max_len=65536 "$work" "$corpus"
done
echo "fuzz: clean"
