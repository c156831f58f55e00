#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz with clang (-fsanitize=fuzzer,address,undefined),
# writes their seed corpus (tests/fuzz/make_seeds.cpp: valid files made by graphmoe's own
# writers) and runs each target for SECONDS seconds, FUZZ_JOBS targets at a time.
#
#   bash scripts/fuzz.sh [SECONDS]      default 30 (what CI runs); from the repository root
#
# Fails (exit 1) on any crash, sanitizer report, broken invariant, uncaught non-graphmoe::Error
# exception, timeout (> 10 s on one input) or out-of-memory (> 2 GB): it prints the fuzzer's
# report, the input that caused it (kept under build-fuzz/artifacts/<target>/) and the commands
# that reproduce it with and without libFuzzer. The corpus grows in build-fuzz/corpus/<target>/
# and is reused by the next run in the same build folder. docs/reliability.md has the targets
# and how to fuzz longer.
#
# Environment:
#   FUZZ_BUILD_DIR   build folder (default build-fuzz)
#   FUZZ_JOBS        targets fuzzed at once, and build parallelism (default 2)
#   FUZZ_TARGETS     space-separated subset of the targets (default: all seven)
#   FUZZ_TMPDIR      where the targets write their input files (default /dev/shm when writable,
#                    else $TMPDIR: rewriting a file on ext4 costs a disk flush, 30x fewer inputs)
#   FUZZ_CXX         the clang++ to use (default clang++)
#   FUZZ_ARGS        extra libFuzzer flags for every target (e.g. "-seed=1" or "-max_len=65536")
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${1:-30}"
if ! [[ "$seconds" =~ ^[1-9][0-9]*$ ]]; then
  echo "fuzz.sh: SECONDS must be a positive integer, got '$seconds'" >&2
  exit 2
fi
build="${FUZZ_BUILD_DIR:-build-fuzz}"
jobs="${FUZZ_JOBS:-2}"
cxx="${FUZZ_CXX:-clang++}"
all_targets=(safetensors training_state text_datasets image_datasets tokenizers hf_config hf_tokenizer)
read -r -a targets <<< "${FUZZ_TARGETS:-${all_targets[*]}}"
read -r -a extra_args <<< "${FUZZ_ARGS:-}"

if ! command -v "$cxx" > /dev/null; then
  echo "fuzz.sh: '$cxx' not found: libFuzzer needs clang (scripts/install-deps.sh installs it)" >&2
  exit 1
fi

echo "== fuzz: build ($cxx, $build)"
# Ninja when installed: it compiles the targets side by side (Make's generator builds the targets
# named on one command line one after the other, each a single translation unit).
generator=()
if command -v ninja > /dev/null && [ ! -f "$build/Makefile" ]; then generator=(-G Ninja); fi
cmake "${generator[@]}" -S tests/fuzz -B "$build" -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_BUILD_TYPE=Debug > /dev/null
build_targets=(fuzz_make_seeds)
for t in "${targets[@]}"; do build_targets+=("fuzz_$t"); done
cmake --build "$build" -j"$jobs" --target "${build_targets[@]}"

rm -rf "$build/seeds" "$build/logs" "$build/status"
"$build/fuzz_make_seeds" "$build/seeds"
mkdir -p "$build/logs" "$build/status"

tmp="${FUZZ_TMPDIR:-}"
if [ -z "$tmp" ] && [ -d /dev/shm ] && [ -w /dev/shm ]; then tmp=/dev/shm; fi
if [ -n "$tmp" ]; then export TMPDIR="$tmp"; fi
export ASAN_OPTIONS="${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"

run_one() {
  local t="$1" rc=0
  local corpus="$build/corpus/$t" artifacts="$build/artifacts/$t"
  mkdir -p "$corpus" "$artifacts"
  local inputs=("$corpus" "$build/seeds/$t")
  if [ -d "tests/fuzz/regressions/$t" ]; then inputs+=("tests/fuzz/regressions/$t"); fi
  "$build/fuzz_$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=4096 \
    -print_final_stats=1 -artifact_prefix="$artifacts/" "${extra_args[@]}" "${inputs[@]}" \
    > "$build/logs/$t.log" 2>&1 || rc=$?
  echo "$rc" > "$build/status/$t"
}

echo "== fuzz: ${targets[*]}, ${seconds} s each, $jobs at a time"
start=$SECONDS
for t in "${targets[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
  run_one "$t" &
done
wait
echo "== fuzz: done in $((SECONDS - start)) s"

failed=()
for t in "${targets[@]}"; do
  rc="$(cat "$build/status/$t" 2> /dev/null || echo missing)"
  execs="$(grep -o 'stat::number_of_executed_units: [0-9]*' "$build/logs/$t.log" | grep -o '[0-9]*$' || true)"
  cov="$(grep -o 'cov: [0-9]* ft: [0-9]*' "$build/logs/$t.log" | tail -1 || true)"
  corpus="$(find "$build/corpus/$t" -type f | wc -l)"
  printf '%-16s exit %-3s %10s inputs  %-20s corpus %s\n' "$t" "$rc" "${execs:-?}" "${cov:-}" "$corpus"
  if [ "$rc" != 0 ]; then failed+=("$t"); fi
done

if [ "${#failed[@]}" -gt 0 ]; then
  for t in "${failed[@]}"; do
    echo
    echo "================ fuzz_$t FAILED: last lines of $build/logs/$t.log ================"
    tail -n 60 "$build/logs/$t.log"
    for a in "$build/artifacts/$t"/*; do
      [ -e "$a" ] || continue
      echo "input: $a ($(stat -c %s "$a") bytes)"
      echo "  reproduce:              $build/fuzz_$t $a"
      echo "  without libFuzzer:      bash scripts/sanitize.sh builds build-asan/tests/fuzz/replay_$t; run it on $a"
      echo "  keep it as a regression: cp $a tests/fuzz/regressions/$t/"
    done
  done
  echo "fuzz.sh: FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "fuzz.sh: ${#targets[@]} targets, no finding"
