#!/usr/bin/env bash
# The CUDA backend's checks on a GPU machine, in one run (a few minutes on one H100):
#   1. configure Release with GRAPHMOE_ENABLE_CUDA=ON into build-gpu, compiling only for the GPU
#      that is present (its compute capability from nvidia-smi; sm_80;90 if that fails)
#   2. build the CUDA targets: test_cuda_ops, graphmoe_cuda_header_check, test_thrust_host
#   3. run them through ctest, and test_cuda_ops once more with every comparison's error printed
#   4. write a summary (GPU, toolkit, per-test results, errors per op) to $OUT/gpu-check-summary.txt
#      when $OUT is set (with the full logs beside it), else to stdout
# Exit status: 0 when everything built and passed.
#
#   bash scripts/gpu-check.sh            # from the repository root or anywhere
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
build=${GRAPHMOE_GPU_BUILD_DIR:-$root/build-gpu}
jobs=${GRAPHMOE_GPU_JOBS:-$(nproc 2>/dev/null || echo 4)}
if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT"
  logdir=$OUT
else
  logdir=$(mktemp -d)
fi
summary=$logdir/gpu-check-summary.txt
: >"$summary"
say() { printf '%s\n' "$*" | tee -a "$summary"; }
t0=$(date +%s)
status=0

say "== graphmoe gpu-check, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
say "commit: $(git rev-parse --short HEAD 2>/dev/null || echo '?') ($(git status --porcelain 2>/dev/null | wc -l) paths changed)"
if command -v nvidia-smi >/dev/null; then
  say "gpu: $(nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv,noheader 2>&1 | head -1)"
  cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
else
  say "gpu: nvidia-smi not found"
  cap=""
fi
[[ "$cap" =~ ^[0-9]+$ ]] && archs=$cap || archs="80;90"
nvcc_bin=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
say "nvcc: $("$nvcc_bin" --version 2>&1 | grep -o 'release [0-9.]*' || echo 'not found')"
say "cmake: $(cmake --version | head -1), architectures: $archs, jobs: $jobs"

step() {  # step NAME LOGFILE COMMAND...: runs COMMAND, logging to LOGFILE, and reports its time
  local name=$1 logfile=$2
  shift 2
  local s=$(date +%s)
  if "$@" >"$logfile" 2>&1; then
    say "$name: ok ($(( $(date +%s) - s )) s)"
  else
    say "$name: FAILED ($(( $(date +%s) - s )) s), last lines of $logfile:"
    tail -n 40 "$logfile" | tee -a "$summary"
    status=1
    return 1
  fi
}

if step configure "$logdir/gpu-check-configure.log" \
     cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGRAPHMOE_ENABLE_CUDA=ON \
       -DCMAKE_CUDA_COMPILER="$nvcc_bin" "-DCMAKE_CUDA_ARCHITECTURES=$archs" \
       -DGRAPHMOE_BUILD_BENCHMARKS=OFF -DGRAPHMOE_BUILD_EXAMPLES=OFF &&
   step build "$logdir/gpu-check-build.log" \
     cmake --build "$build" -j "$jobs" --target test_cuda_ops graphmoe_cuda_header_check test_thrust_host; then
  step ctest "$logdir/gpu-check-ctest.log" \
    ctest --test-dir "$build" -R "test_cuda_ops|test_thrust_host" --output-on-failure --timeout 300
  say "-- ctest results"
  grep -E "Test +#[0-9]+:" "$logdir/gpu-check-ctest.log" | sed -E 's/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: //; s/ \.{3,}/ /' | tee -a "$summary"
  grep -E "tests passed|tests failed" "$logdir/gpu-check-ctest.log" | tee -a "$summary"
  say "-- test_cuda_ops, error of every CUDA result against the CPU (normwise, max|d| / max|ref|)"
  if ! GRAPHMOE_CUDA_TEST_VERBOSE=1 timeout 300 "$build/tests/test_cuda_ops" \
         >"$logdir/gpu-check-errors.log" 2>&1; then
    status=1
  fi
  tee -a "$summary" <"$logdir/gpu-check-errors.log"
  if grep -q "skipped: no CUDA device" "$logdir/gpu-check-errors.log"; then
    say "FAIL: test_cuda_ops found no CUDA device: nothing ran on a GPU"
    status=1
  fi
fi
say "== total $(( $(date +%s) - t0 )) s, status $([[ $status == 0 ]] && echo PASS || echo FAIL)"
[[ -z "${OUT:-}" ]] && echo "(logs in $logdir)"
exit $status
