#!/usr/bin/env bash
# Installs everything graphmoe needs to build, test and benchmark on Debian 12.
# Idempotent and non-interactive; safe to run repeatedly.
#   GRAPHMOE_SKIP_PIP=1   skip the PyPI packages (safetensors, used by interop tests)
set -euo pipefail

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

apt_packages=(
  build-essential cmake git pkg-config ca-certificates
  libeigen3-dev doctest-dev libbenchmark-dev
  libopenblas-dev
  nlohmann-json3-dev libcli11-dev
  python3 python3-numpy
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

echo "install-deps: done"
