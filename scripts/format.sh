#!/usr/bin/env bash
# clang-format over the project's C++/CUDA sources. --check: report differences and fail.
set -euo pipefail
cd "$(dirname "$0")/.."
files=$(git ls-files '*.cpp' '*.hpp' '*.h' '*.cc' '*.cu' '*.cuh' 2>/dev/null || true)
[ -n "$files" ] || exit 0
if ! command -v clang-format >/dev/null 2>&1; then
  echo "format: clang-format not found; skipping the check"; exit 0
fi
if [ "${1:-}" = "--check" ]; then
  echo "$files" | xargs clang-format --dry-run --Werror
  echo "format: clean"
else
  echo "$files" | xargs clang-format -i
fi
