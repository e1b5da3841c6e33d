#!/usr/bin/env bash
# Installs what fp8moe needs on a fresh Debian machine, idempotently:
#  - Debian packages (only the missing ones, through apt-get);
#  - pinned PyPI packages into the git-ignored project folder .deps/python (tests and CUDA headers).
# Safe to run again: it does nothing when everything is present.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(build-essential cmake ninja-build pkg-config git python3 python3-pip
  libgtest-dev libgmock-dev googletest libbenchmark-dev libcli11-dev nlohmann-json3-dev libfmt-dev
  libhwy-dev clang libclang-rt-14-dev clang-format)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# python3 / pip may come from elsewhere (pyenv); only ask apt for them when they are absent.
if command -v python3 >/dev/null 2>&1; then
  missing=("${missing[@]/python3}")
  python3 -m pip --version >/dev/null 2>&1 && missing=("${missing[@]/python3-pip}")
fi
# clang-format is only used for the format check; any version on PATH will do.
command -v clang-format >/dev/null 2>&1 && missing=("${missing[@]/clang-format}")
clean=()
for p in "${missing[@]}"; do [ -n "$p" ] && clean+=("$p"); done
if [ ${#clean[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${clean[*]}"
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get install -y --no-install-recommends "${clean[@]}" || {
    $SUDO apt-get update
    $SUDO apt-get install -y --no-install-recommends "${clean[@]}"
  }
fi

# Pinned PyPI packages. numpy/ml_dtypes/safetensors: independent fp8 codec and real checkpoint writer for
# tests. nvidia-cutlass: CUTLASS/CuTe headers for the CUDA kernels (headers only, so --no-deps).
export PIP_ROOT_USER_ACTION=ignore
PY_DIR=.deps/python
PY_PINS="numpy==2.2.6 ml_dtypes==0.5.1 safetensors==0.5.3"
CUTLASS_PIN="nvidia-cutlass==4.2.0.0"
stamp="$PY_DIR/.stamp"
want="$PY_PINS $CUTLASS_PIN"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup: installing pinned Python packages into $PY_DIR"
  rm -rf "$PY_DIR"
  mkdir -p "$PY_DIR"
  python3 -m pip install -q --disable-pip-version-check --no-warn-script-location --target "$PY_DIR" $PY_PINS
  python3 -m pip install -q --disable-pip-version-check --no-warn-script-location --no-deps --target "$PY_DIR" $CUTLASS_PIN
  echo "$want" > "$stamp"
fi
echo "setup: ok"
