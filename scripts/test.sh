#!/usr/bin/env bash
# The whole test suite, phase by phase, as CI runs it (.ci/run: scripts/install-deps.sh, then this):
#
#   configure  cmake -G Ninja -C cmake/ci.cmake (Release; Ninja when installed, else Makefiles)
#   build      cmake --build build -j$JOBS (every test program, the examples, the benchmarks, the
#              syntax check of every example router the build leaves out)
#   ctest      ctest --test-dir build --output-on-failure -j$JOBS
#   sanitize   scripts/sanitize.sh (the ASan + UBSan subset: build and run)
#   fuzz       scripts/fuzz.sh 30 (every file reader, 30 s each)
#
# It ends by printing each phase's wall and CPU time (user + system of every process the phase
# ran, from bash's `times`), also when a phase fails; the run stops at the first failing phase.
#
#   bash scripts/test.sh              from the repository root (build folder: build)
#
# Environment: BUILD_DIR (default build), JOBS (default 2), FUZZ_SECONDS (default 30).
set -uo pipefail
cd "$(dirname "$0")/.."

build="${BUILD_DIR:-build}"
jobs="${JOBS:-2}"
fuzz_seconds="${FUZZ_SECONDS:-30}"
generator=()
if command -v ninja > /dev/null && [ ! -f "$build/Makefile" ]; then generator=(-G Ninja); fi

# The CPU seconds (user + system) of every child process waited for so far, into $cpu_now: the
# second line of bash's `times` ("XmY.YYYs XmY.YYYs"), run in this shell (in a command
# substitution it would count the subshell's children only).
times_file="$(mktemp)"
trap 'rm -f "$times_file"' EXIT
cpu_now=0
children_cpu() {
  times > "$times_file"
  cpu_now="$(tail -n 1 "$times_file" | awk '{
    t = 0
    for (i = 1; i <= 2; ++i) { split($i, p, "m"); sub("s", "", p[2]); t += p[1] * 60 + p[2] }
    printf "%.1f", t }')"
}

names=()
walls=()
cpus=()
results=()
run_start=$SECONDS
children_cpu
run_cpu0="$cpu_now"

summary() {
  local total_wall=$((SECONDS - run_start))
  local total_cpu
  children_cpu
  total_cpu="$(awk -v a="$cpu_now" -v b="$run_cpu0" 'BEGIN { printf "%.1f", a - b }')"
  echo
  echo "== phase times ($(nproc) CPUs: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'))"
  printf '%-10s %-7s %10s %12s\n' phase result "wall (s)" "CPU (s)"
  local i
  for i in "${!names[@]}"; do
    printf '%-10s %-7s %10s %12s\n' "${names[$i]}" "${results[$i]}" "${walls[$i]}" "${cpus[$i]}"
  done
  printf '%-10s %-7s %10s %12s   (%d:%02d wall, %.1f CPU-minutes)\n' total "" "$total_wall" \
    "$total_cpu" $((total_wall / 60)) $((total_wall % 60)) \
    "$(awk -v c="$total_cpu" 'BEGIN { print c / 60 }')"
}

phase() {
  local name="$1"
  shift
  echo "== $name: $*"
  local w0=$SECONDS c0 rc=0
  children_cpu
  c0="$cpu_now"
  "$@" || rc=$?
  names+=("$name")
  walls+=($((SECONDS - w0)))
  children_cpu
  cpus+=("$(awk -v a="$cpu_now" -v b="$c0" 'BEGIN { printf "%.1f", a - b }')")
  if [ "$rc" -ne 0 ]; then
    results+=("FAILED")
    summary
    echo "test.sh: FAILED in phase '$name' (exit $rc)" >&2
    exit "$rc"
  fi
  results+=("ok")
}

phase configure cmake "${generator[@]}" -C cmake/ci.cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release
phase build cmake --build "$build" -j"$jobs"
phase ctest ctest --test-dir "$build" --output-on-failure -j"$jobs"
phase sanitize env SANITIZE_JOBS="$jobs" bash scripts/sanitize.sh
phase fuzz env FUZZ_JOBS="$jobs" bash scripts/fuzz.sh "$fuzz_seconds"
summary
echo "test.sh: passed"
