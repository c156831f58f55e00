#!/usr/bin/env bash
# Installs everything graphmoe needs to build, test and benchmark on Debian 12.
# Idempotent and non-interactive; safe to run repeatedly.
#   GRAPHMOE_SKIP_PIP=1   skip the PyPI packages (safetensors, tokenizers, sentencepiece: interop tests)
set -euo pipefail

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

apt_packages=(
  build-essential cmake ninja-build git pkg-config ca-certificates
  libeigen3-dev doctest-dev libbenchmark-dev
  libopenblas-dev
  nlohmann-json3-dev libcli11-dev
  python3 python3-numpy python3-matplotlib
  zlib1g-dev dataset-fashion-mnist
  clang libclang-rt-dev llvm  # scripts/fuzz.sh: clang, libFuzzer + sanitizer runtimes, llvm-symbolizer
  bible-kjv bible-kjv-text
  libopenmpi-dev openmpi-bin  # graphmoe::mpi (dist/mpi.hpp) and its tests under mpiexec
  libpcre2-dev libutf8proc-dev  # graphmoe::hf_tokenizer (hf/tokenizer.hpp): regexes, NFC
  libsentencepiece-dev          # graphmoe::hf_sentencepiece (hf/sentencepiece.hpp)
)

missing=()
for p in "${apt_packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ "${#missing[@]}" -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -y
  $SUDO apt-get install -y --no-install-recommends "${missing[@]}"
fi

# PyPI packages for /usr/bin/python3 (the interpreter tests/CMakeLists.txt tries first): the real
# safetensors library and numpy, used by the checkpoint interop test, and the `tokenizers` and
# `sentencepiece` packages, the references of test_hf_tokenizer (tests/hf/make_tokenizers.py). Debian 12's pip refuses to
# touch the system Python without --break-system-packages (PEP 668). Skipped when already importable.
if [ "${GRAPHMOE_SKIP_PIP:-0}" != "1" ]; then
  if ! /usr/bin/python3 -c "import safetensors, numpy, tokenizers, sentencepiece" >/dev/null 2>&1; then
    if ! /usr/bin/python3 -m pip --version >/dev/null 2>&1; then
      export DEBIAN_FRONTEND=noninteractive
      $SUDO apt-get update -y
      $SUDO apt-get install -y --no-install-recommends python3-pip
    fi
    pip_flags=(--quiet --disable-pip-version-check --no-input)
    if /usr/bin/python3 -m pip install --help 2>/dev/null | grep -q -- --break-system-packages; then
      pip_flags+=(--break-system-packages)
    fi
    $SUDO env PIP_ROOT_USER_ACTION=ignore /usr/bin/python3 -m pip install "${pip_flags[@]}" safetensors numpy \
      tokenizers sentencepiece
    /usr/bin/python3 -c "import safetensors, numpy, tokenizers, sentencepiece"
  fi
fi

echo "install-deps: done"
