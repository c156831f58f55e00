#!/usr/bin/env bash
# Prepares, on this (networked) machine, the build dependencies that scripts/gpu-check.sh needs on
# a GPU machine that can reach no package registry: the Debian packages of Eigen, doctest, Google
# Benchmark, nlohmann_json, zlib's headers and CLI11 (for the examples: main-job.sh OFFLINE=1) are
# downloaded and unpacked into .gpu-deps/root (about 12 MB; ignored by git through
# .git/info/exclude). gpu-check.sh and scripts/gpu-train.sh find them there.
#
#   bash scripts/gpu-deps.sh          # once, before handing the tree to the GPU machine
#   (device run: carry [".gpu-deps"], command: bash scripts/gpu-check.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
packages=(libeigen3-dev doctest-dev libbenchmark-dev libbenchmark1debian nlohmann-json3-dev
          zlib1g-dev libcli11-dev)
grep -qx '/.gpu-deps/' .git/info/exclude 2>/dev/null || echo '/.gpu-deps/' >>.git/info/exclude
rm -rf .gpu-deps
mkdir -p .gpu-deps/debs .gpu-deps/root
(cd .gpu-deps/debs && apt-get download "${packages[@]}")
for f in .gpu-deps/debs/*.deb; do dpkg -x "$f" .gpu-deps/root; done
rm -rf .gpu-deps/debs .gpu-deps/root/usr/share/doc
# doctest's exported targets name /usr itself; make them relative to where they were unpacked
sed -i 's|^set(_IMPORT_PREFIX "/usr")$|get_filename_component(_IMPORT_PREFIX "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)|' \
  .gpu-deps/root/usr/lib/cmake/doctest/doctestTargets.cmake
grep -q 'CMAKE_CURRENT_LIST_DIR' .gpu-deps/root/usr/lib/cmake/doctest/doctestTargets.cmake
du -sh .gpu-deps
