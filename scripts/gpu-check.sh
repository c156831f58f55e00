#!/usr/bin/env bash
# The CUDA backend's checks on a GPU machine, in one run (about 5 minutes on one H100, at most
# GRAPHMOE_GPU_BUDGET_S = 470 s: every step runs under `timeout`, clipped to what is left):
#   1. configure Release with GRAPHMOE_ENABLE_CUDA=ON and the benchmarks into build-gpu, compiling
#      only for the GPU that is present (its compute capability from nvidia-smi; sm_80;90 if that
#      fails); without Google Benchmark, configure again without the benchmarks
#   2. build every CUDA and host-Thrust target the tree defines (test_cuda_*, test_host_*,
#      test_thrust_host, graphmoe_cuda_header_check) and bench_cuda, in one parallel build that
#      keeps going past a failing target; the summary says which targets built
#   3. run their tests through ctest
#   4. run bench_cuda (short: --benchmark_min_time=0.1, 3 repetitions, medians) into
#      bench_cuda.json, and benchmarks/compare/cuda_report.py on it (the GPU targets)
#   5. run each test_cuda_* binary once more with every comparison's error printed
#   6. write a summary (GPU, toolkit, per-step and per-target results, per-test results, the
#      benchmark and its report, errors per op) to $OUT/gpu-check-summary.txt when $OUT is set
#      (with the full logs beside it: 8 files at most), else to stdout
# A failing step does not stop the later ones; the summary's last lines name the failed steps.
# Exit status: 0 when everything built and passed.
#
#   bash scripts/gpu-check.sh            # from the repository root or anywhere
# A shorter rerun (a second device call after a fix): GRAPHMOE_GPU_TARGETS, an extended regex,
# keeps only the targets it matches (their tests alone run), and GRAPHMOE_GPU_BENCH_FILTER is
# bench_cuda's --benchmark_filter, e.g.
#   GRAPHMOE_GPU_TARGETS='test_cuda_nn_ops|bench_cuda' GRAPHMOE_GPU_BENCH_FILTER='_large/' \
#     bash scripts/gpu-check.sh
# (GRAPHMOE_GPU_BENCH_CAP_S, 150 by default: the benchmark step's own cap, within the budget.)
# On a GPU machine without package access, first run `bash scripts/gpu-deps.sh` on a networked
# machine and carry .gpu-deps with the tree (device tool: carry [".gpu-deps"]).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
root=$(pwd)
build=${GRAPHMOE_GPU_BUILD_DIR:-$root/build-gpu}
jobs=${GRAPHMOE_GPU_JOBS:-$(nproc 2>/dev/null || echo 4)}
budget=${GRAPHMOE_GPU_BUDGET_S:-470}
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
failed=()

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
python_bin=$(command -v python3 || echo /usr/bin/python3)
say "nvcc: $("$nvcc_bin" --version 2>&1 | grep -o 'release [0-9.]*' || echo 'not found')"
say "cmake: $(cmake --version | head -1), architectures: $archs, jobs: $jobs, budget: $budget s"

# limit CAP [RESERVE]: seconds a step may take: CAP, or what is left of the budget after RESERVE
# seconds kept for the steps after it, if that is less (0 when nothing is left).
limit() {
  local left=$(( budget - ($(date +%s) - t0) - ${2:-0} ))
  if (( left < $1 )); then
    echo $(( left > 0 ? left : 0 ))
  else
    echo "$1"
  fi
}

fail() {  # fail NAME: records a failed step
  failed+=("$1")
  status=1
}

step() {  # step NAME LOGFILE CAP RESERVE COMMAND...: runs COMMAND under `timeout` (see limit),
          # logging to LOGFILE, and reports its time
  local name=$1 logfile=$2 t
  t=$(limit "$3" "$4")
  shift 4
  if (( t < 5 )); then
    say "$name: SKIPPED (the ${budget} s budget is spent)"
    fail "$name"
    return 1
  fi
  local s rc=0
  s=$(date +%s)
  timeout -k 10 "$t" "$@" >"$logfile" 2>&1 || rc=$?
  if (( rc == 0 )); then
    say "$name: ok ($(( $(date +%s) - s )) s)"
  else
    if (( rc == 124 || rc == 137 )); then
      say "$name: FAILED (timed out after $t s), last lines of $logfile:"
    else
      say "$name: FAILED (exit $rc, $(( $(date +%s) - s )) s), last lines of $logfile:"
    fi
    tail -n 40 "$logfile" | tee -a "$summary"
    fail "$name"
    return 1
  fi
}

configure_log=$logdir/gpu-check-configure.log
build_log=$logdir/gpu-check-build.log
ctest_log=$logdir/gpu-check-ctest.log
bench_log=$logdir/gpu-check-bench.log
bench_json=$logdir/bench_cuda.json
report_log=$logdir/gpu-check-report.txt
errors_log=$logdir/gpu-check-errors.log

# Ninja when the build folder is new and ninja is there: it builds the targets in parallel (the
# Makefiles' top level makes one target at a time). An existing build folder keeps its generator.
generator=()
if [[ ! -f "$build/CMakeCache.txt" ]] && command -v ninja >/dev/null; then
  generator=(-G Ninja)
fi

# The build dependencies carried from a networked machine (scripts/gpu-deps.sh), when present:
# the GPU machine has CMake, ninja and the CUDA toolkit but no Eigen, doctest, Google Benchmark,
# nlohmann_json or zlib headers, and cannot download them.
source "$root/scripts/gpu-deps-env.sh" "$root"
if (( ${#dep_args[@]} > 0 )); then
  say "dependencies: carried in $gpu_deps"
else
  say "dependencies: from the system (no .gpu-deps; run scripts/gpu-deps.sh where apt works)"
fi

configure() {  # configure BENCHMARKS(ON|OFF) LOGFILE
  step "configure (benchmarks $1)" "$2" 180 0 \
    cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DGRAPHMOE_ENABLE_CUDA=ON \
      -DCMAKE_CUDA_COMPILER="$nvcc_bin" "-DCMAKE_CUDA_ARCHITECTURES=$archs" \
      "-DGRAPHMOE_BUILD_BENCHMARKS=$1" -DGRAPHMOE_BUILD_EXAMPLES=OFF "${dep_args[@]}"
}

configured=0
if configure ON "$configure_log"; then
  configured=1
else
  say "(configuring again without the benchmarks: bench_cuda needs Google Benchmark)"
  configure OFF "$configure_log.off" && configured=1
  cat "$configure_log.off" >>"$configure_log" 2>/dev/null
  rm -f "$configure_log.off"
fi

if (( configured )); then
  # The targets this tree defines, from the build system's list (Ninja: every output; Makefiles:
  # the help target), filtered by name.
  if grep -q '^CMAKE_GENERATOR:INTERNAL=Ninja' "$build/CMakeCache.txt" 2>/dev/null; then
    all_targets=$(ninja -C "$build" -t targets all 2>/dev/null)
    keep_going=(-k 0)  # keep going past a failing target, so that the others still build
  else
    all_targets=$(cmake --build "$build" --target help 2>/dev/null)
    keep_going=(-k)
  fi
  targets=$(sed -E 's/^\.\.\. //; s/:.*$//' <<<"$all_targets" |
    grep -E '^(test_cuda_[A-Za-z0-9_]+|test_host_[A-Za-z0-9_]+|test_thrust_host|graphmoe_cuda_header_check|bench_cuda)$' |
    sort -u | tr '\n' ' ')
  if [[ -n "${GRAPHMOE_GPU_TARGETS:-}" ]]; then
    targets=$(tr ' ' '\n' <<<"$targets" | grep -E "^(${GRAPHMOE_GPU_TARGETS})\$" | tr '\n' ' ')
    say "GRAPHMOE_GPU_TARGETS=${GRAPHMOE_GPU_TARGETS}: only these"
  fi
  say "targets: ${targets:-none}"
  [[ -n "$targets" ]] || fail "targets (none defined: is the CUDA backend configured?)"
  # shellcheck disable=SC2086  # targets is a list of names
  [[ -n "$targets" ]] && step build "$build_log" 330 120 cmake --build "$build" -j "$jobs" --target $targets -- "${keep_going[@]}"
  say "-- targets built"
  for t in $targets; do
    # built: no error line of the build names the target (its object folder or its output), and
    # its output exists
    if grep -E 'Error [0-9]+|FAILED:|not remade' "$build_log" |
         grep -Eq "CMakeFiles/$t\.dir/|/$t( |\]|$)"; then
      ok=0
    elif [[ $t == graphmoe_cuda_header_check ]]; then
      [[ -n $(find "$build" -path "*/CMakeFiles/$t.dir/*.o" -print -quit) ]] && ok=1 || ok=0
    else
      [[ -n $(find "$build" -type f -name "$t" -perm -u+x -print -quit) ]] && ok=1 || ok=0
    fi
    if (( ok )); then say "  $t: built"; else say "  $t: NOT BUILT"; fail "build $t"; fi
  done

  ctest_jobs=$(( jobs < 8 ? jobs : 8 ))
  ctest_regex="^(test_cuda_|test_host_|test_thrust_host)"
  if [[ -n "${GRAPHMOE_GPU_TARGETS:-}" ]]; then
    tests_kept=$(tr ' ' '\n' <<<"$targets" | grep -E '^test_' | paste -sd '|')
    ctest_regex="^(${tests_kept:-no_test_selected}):"
  fi
  step ctest "$ctest_log" 200 90 \
    ctest --test-dir "$build" -R "$ctest_regex" -j "$ctest_jobs" \
      --output-on-failure --timeout 120 --no-tests=error
  say "-- ctest results"
  grep -E "Test +#[0-9]+:" "$ctest_log" | sed -E 's/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: //; s/ \.{3,}/ /' | tee -a "$summary"
  grep -E "tests passed|tests failed" "$ctest_log" | tee -a "$summary"

  say "-- bench_cuda (--benchmark_min_time=0.1, 3 repetitions, aggregates)"
  if [[ " $targets " == *" bench_cuda "* && -x "$build/benchmarks/bench_cuda" ]]; then
    rm -f "$bench_json"
    step bench_cuda "$bench_log" "${GRAPHMOE_GPU_BENCH_CAP_S:-150}" 15 \
      "$build/benchmarks/bench_cuda" --benchmark_min_time=0.1 --benchmark_repetitions=3 \
        "--benchmark_filter=${GRAPHMOE_GPU_BENCH_FILTER:-.}" \
        --benchmark_report_aggregates_only=true --benchmark_out="$bench_json" \
        --benchmark_out_format=json
    tee -a "$summary" <"$bench_log"
    if grep -q "no CUDA device" "$bench_log"; then
      say "FAIL: bench_cuda found no CUDA device"
      fail "bench_cuda (no CUDA device)"
    fi
    say "-- cuda_report.py"
    step cuda_report "$report_log" 60 0 "$python_bin" "$root/benchmarks/compare/cuda_report.py" "$bench_json"
    tee -a "$summary" <"$report_log"
    grep -q "^## Errors" "$report_log" && fail "bench_cuda (benchmarks that ended with an error)"
  else
    say "bench_cuda: not run (not configured or not built)"
    fail "bench_cuda (not built)"
  fi

  say "-- error of every CUDA result against the CPU (normwise, max|d| / max|ref|), per test binary"
  : >"$errors_log"
  for t in $targets; do
    [[ $t == test_cuda_* && -x "$build/tests/$t" ]] || continue
    lim=$(limit 90)
    if (( lim < 5 )); then
      say "$t: SKIPPED (the ${budget} s budget is spent)"
      fail "errors $t"
      continue
    fi
    echo "== $t" >>"$errors_log"
    if ! GRAPHMOE_CUDA_TEST_VERBOSE=1 timeout -k 10 "$lim" "$build/tests/$t" >>"$errors_log" 2>&1; then
      say "$t (verbose run): FAILED"
      fail "errors $t"
    fi
  done
  tee -a "$summary" <"$errors_log"
  if grep -q "skipped: no CUDA device" "$errors_log"; then
    say "FAIL: the CUDA tests found no CUDA device: nothing ran on a GPU"
    fail "tests (no CUDA device)"
  fi
fi
if (( ${#failed[@]} > 0 )); then
  say "failed steps: $(printf '%s; ' "${failed[@]}")"
fi
say "== total $(( $(date +%s) - t0 )) s, status $([[ $status == 0 ]] && echo PASS || echo FAIL)"
[[ -z "${OUT:-}" ]] && echo "(logs in $logdir)"
exit $status
