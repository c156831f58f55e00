#!/usr/bin/env bash
# Kernel time per kernel of bench_cuda filters under Nsight Systems (GPU machine, after
# scripts/gpu-check.sh built build-gpu/benchmarks/bench_cuda), one profile per filter
# (several filters separated by ';'):
#   GRAPHMOE_PROFILE_FILTER='graph_large/float/similarity-bf16/fwdbwd' bash scripts/gpu-profile.sh
# writes the cuda_gpu_kern_sum and cuda_api_sum reports (nsys stats) to $OUT/gpu-profile.txt
# (stdout without $OUT). Exit status: nsys's, or 1 when nsys or the benchmark is missing.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
bench=${GRAPHMOE_GPU_BUILD_DIR:-$(pwd)/build-gpu}/benchmarks/bench_cuda
filter=${GRAPHMOE_PROFILE_FILTER:?set GRAPHMOE_PROFILE_FILTER to one bench_cuda filter}
out=${OUT:-$(mktemp -d)}
report=$out/gpu-profile.txt
# (The lent machines' image has Nsight Compute but no working nsys as of 2026-11: this script
# then says so and exits 1; .library/device/KINDS.md.)
nsys_bin=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
if [[ -z "$nsys_bin" || ! -x "$bench" ]]; then
  echo "gpu-profile: nsys (${nsys_bin:-not found}) or $bench missing" | tee "$report"
  exit 1
fi
tmp=$(mktemp -d)
rc=0
: >"$report"
IFS=';' read -r -a filters <<<"$filter"
for f in "${filters[@]}"; do
  {
    echo "== nsys profile of bench_cuda --benchmark_filter='$f' ($(date -u +%FT%TZ))"
    "$nsys_bin" profile -o "$tmp/prof" --force-overwrite true -t cuda "$bench" \
      "--benchmark_filter=$f" --benchmark_min_time=0.05 2>&1 | grep -E "manual_time|rror" | head -n 8
    "$nsys_bin" stats -q --report cuda_gpu_kern_sum --format table "$tmp/prof.nsys-rep" 2>&1 |
      cut -c1-200 | head -n 30
  } >>"$report" 2>&1 || rc=1
done
cat "$report"
exit $rc
