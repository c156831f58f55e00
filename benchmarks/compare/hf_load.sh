#!/usr/bin/env bash
# How long graphmoe takes to load a 1 GB Hugging Face checkpoint, beside the time to read its files
# (from the repository root):
#
#   bash benchmarks/compare/hf_load.sh [BUILD_DIR]        # BUILD_DIR: default build-peer
#
# 1. benchmarks/hf_load built into BUILD_DIR (Release, configured here if it is not).
# 2. The model: `hf_load --make` writes a random Mixtral-shaped model with graphmoe's writer into
#    MODEL_DIR (default runs/hf-load/mixtral-1g; kept, a rerun reuses it): 8 blocks, hidden 1024,
#    16 heads (4 key/value heads), 8 experts of 2304, vocabulary 32,000, bf16, shards of at most
#    0.5 GB with an index (1.08 GB in 3 shards).
# 3. hf_load MODEL_DIR --reps REPS (3) --threads 2, warm (the files in the page cache) and then
#    --cold (each file's cached pages dropped before each step with posix_fadvise). The page cache
#    is the machine's: run it on an otherwise idle machine.
# 4. The report: OUT (benchmarks/results/hf/<today>-load.txt): the machine, the commands, both
#    outputs; the target (load <= 2x the read) is judged on the mean ratios.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD_DIR=${1:-build-peer}
MODEL_DIR=${MODEL_DIR:-runs/hf-load/mixtral-1g}
REPS=${REPS:-3}
OUT=${OUT:-benchmarks/results/hf/$(date +%Y-%m-%d)-load.txt}
JOBS=${JOBS:-2}
COMMAND="bash benchmarks/compare/hf_load.sh $*"

unset OPENBLAS_CORETYPE
coretype=$(bash scripts/openblas-coretype.sh)
[[ -n "$coretype" ]] && export OPENBLAS_CORETYPE=$coretype
export OPENBLAS_NUM_THREADS=2

if [[ ! -f "$BUILD_DIR/CMakeCache.txt" ]]; then
  cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DGRAPHMOE_NATIVE=ON -DGRAPHMOE_ENABLE_CUDA=OFF \
    -DGRAPHMOE_BUILD_TESTS=OFF -DGRAPHMOE_BUILD_BENCHMARKS=ON -DGRAPHMOE_BUILD_EXAMPLES=OFF > /dev/null
fi
cmake --build "$BUILD_DIR" -j "$JOBS" --target hf_load > /dev/null
BIN=$BUILD_DIR/benchmarks/hf_load

if [[ ! -f "$MODEL_DIR/config.json" ]]; then
  mkdir -p "$(dirname "$MODEL_DIR")"
  "$BIN" --make "$MODEL_DIR" --dtype bf16 --shard-gb 0.5
fi

warm=$("$BIN" "$MODEL_DIR" --reps "$REPS" --threads 2)
cold=$("$BIN" "$MODEL_DIR" --reps "$REPS" --threads 2 --cold)
ratio() { sed -n 's/^mean over .*load \/ read \([0-9.]*\).*/\1/p' <<< "$1"; }
judge() { awk -v r="$1" 'BEGIN { print (r <= 2.0 ? "met" : "not met") }'; }
spread() {  # the rounds' smallest and largest load / read
  sed -n 's/^round .*load \/ read \([0-9.]*\)$/\1/p' <<< "$1" |
    awk 'NR == 1 || $1 < lo { lo = $1 } NR == 1 || $1 > hi { hi = $1 } END { printf "rounds %s-%s", lo, hi }'
}

mkdir -p "$(dirname "$OUT")"
{
  echo "hf::load_lm (float) of a 1 GB Hugging Face checkpoint beside reading its files"
  echo "command: $COMMAND"
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'), $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo)"
  echo "filesystem: $(df -hT "$MODEL_DIR" | awk 'NR == 2 {print $2, $1}')"
  echo "OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-unset} OPENBLAS_NUM_THREADS=$OPENBLAS_NUM_THREADS"
  echo "model: $MODEL_DIR ($(cat "$MODEL_DIR"/config.json | tr -d '\n ' | head -c 200)...)"
  echo
  echo "== warm page cache: $BIN $MODEL_DIR --reps $REPS --threads 2"
  echo "$warm"
  echo
  echo "== cold (posix_fadvise DONTNEED before each step): $BIN $MODEL_DIR --reps $REPS --threads 2 --cold"
  echo "$cold"
  echo
  echo "target: load <= 2x the time to read the files (the ratio of the means): warm $(ratio "$warm") ($(spread "$warm"); $(judge "$(ratio "$warm")")), cold $(ratio "$cold") ($(spread "$cold"); $(judge "$(ratio "$cold")"))"
} > "$OUT"
cat "$OUT"
