#!/usr/bin/env bash
# The modern routers' study of docs/results.md: does the graph of tokens help the routers that
# replaced softmax top-k? At the main job's scale and with its hyper-parameters (scripts/main-job.sh:
# King James Bible, 4 blocks, D = 128, 4 heads, E = 8 experts of d_ff = 256, top-2, sequences of 64,
# batch 16, 1,500 steps, AdamW 2e-3 -> 2e-4 after 50 warm-up steps, tau = 32 for the Similarity
# graph), fixed before any row was compared and the same for every row; only the router and the
# MoE structure change:
#
#   softmax, similarity, attention          softmax top-k with the auxiliary loss (0.01)
#   sigmoid-bias, sigmoid-bias-similarity,  sigmoid scores, auxiliary-loss-free bias balancing
#   sigmoid-bias-attention                  (rate 1e-3), no auxiliary loss
#   shared, shared-similarity               softmax top-k plus one shared expert of d_ff = 256
#   fine, fine-similarity                   E = 64 experts of d_ff = 64, top-8 (the same active
#                                           expert width, 8 x 64 = 2 x 256)
#
#   scripts/study/modern.sh [CELL...]       every cell (or the ones named) for SEEDS (default 1 2 3)
#   BUILD=build-modern JOBS=2 SEEDS="1 2 3" scripts/study/modern.sh
#   scripts/study/modern.sh --table         the table of docs/results.md from the finished runs
#
# Runs JOBS cells side by side (default 2, one thread each), each under runs/study/modern/<cell>/
# s<seed>/ (train_lm's output, metrics.csv, result.txt); a finished cell is skipped. The build needs
# train_lm with the six routers (BUILD is configured here when missing):
#   -DGRAPHMOE_EXAMPLE_ROUTERS="SoftmaxRouter;SimilarityRouter;AttentionRouter;SigmoidBiasRouter;
#                               SimilaritySigmoidBiasRouter;AttentionSigmoidBiasRouter"
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${BUILD:-$ROOT/build-modern}
MODERN_RUNS=${MODERN_RUNS:-${RUNS:-$ROOT/runs/study}/modern}
export BUILD MODERN_RUNS
SEEDS=${SEEDS:-"1 2 3"}
JOBS=${JOBS:-2}
CELLS=(softmax similarity attention sigmoid-bias sigmoid-bias-similarity sigmoid-bias-attention
       shared shared-similarity fine fine-similarity)

if [[ "${1:-}" == --table ]]; then
  exec /usr/bin/python3 "$ROOT/scripts/study/modern_table.py" --runs "$MODERN_RUNS" "${CELLS[@]}"
fi

cell_args() {  # the router and structure of a cell
  case "$1" in
    softmax) echo --router softmax ;;
    similarity) echo --router similarity --tau 32 ;;
    attention) echo --router attention ;;
    sigmoid-bias) echo --router sigmoid-bias --load-balance 0 ;;
    sigmoid-bias-similarity) echo --router sigmoid-bias-similarity --tau 32 --load-balance 0 ;;
    sigmoid-bias-attention) echo --router sigmoid-bias-attention --load-balance 0 ;;
    shared) echo --router softmax --shared-d-ff 256 ;;
    shared-similarity) echo --router similarity --tau 32 --shared-d-ff 256 ;;
    fine) echo --router softmax --experts 64 --top-k 8 --expert-d-ff 64 ;;
    fine-similarity) echo --router similarity --tau 32 --experts 64 --top-k 8 --expert-d-ff 64 ;;
    *) echo "modern.sh: unknown cell '$1' (${CELLS[*]})" >&2; return 2 ;;
  esac
}

if [[ "${1:-}" == --cell ]]; then  # one run: --cell CELL SEED (what the parallel loop below calls)
  cell=$2 seed=$3 dir=$MODERN_RUNS/$2/s$3
  if [[ -s "$dir/result.txt" ]]; then echo "skip $cell/s$seed"; exit 0; fi
  read -r -a args <<< "$(cell_args "$cell")"
  # the main job's settings of the options a cell may change, unless the cell changes them (train_lm
  # refuses an option given twice)
  for default in "--load-balance 0.01" "--experts 8" "--top-k 2"; do
    [[ " ${args[*]} " == *" ${default%% *} "* ]] || read -r -a args <<< "${args[*]} $default"
  done
  rm -rf "$dir" && mkdir -p "$dir"
  t0=$SECONDS
  export OPENBLAS_NUM_THREADS=1
  "$BUILD/examples/train_lm" --train "$ROOT/runs/data/kjv.tokens" --test "" --valid-fraction 0.05 \
    --max-vocab 8000 --layers 4 --d-model 128 --heads 4 --d-ff 256 --seq 64 \
    --batch 16 --steps 1500 --warmup 50 --lr 2e-3 --min-lr 2e-4 --eval-every 100 --eval-batches 20 \
    --threads 1 --sample-tokens 0 --seed "$seed" --out "$dir" "${args[@]}" \
    > "$dir/train.out" 2> "$dir/train.err" ||
    { echo "FAILED $cell/s$seed: $(tail -n 2 "$dir/train.err" | tr '\n' ' ')" >&2; exit 1; }
  experts=8
  [[ "$cell" == fine* ]] && experts=64
  echo "$(grep '^router=' "$dir/train.out") experts=$experts wall_s=$((SECONDS - t0))" > "$dir/result.txt.tmp"
  mv "$dir/result.txt.tmp" "$dir/result.txt"
  echo "done $cell/s$seed: $(cat "$dir/result.txt")"
  exit 0
fi

(( $# > 0 )) && CELLS=("$@")
for c in "${CELLS[@]}"; do cell_args "$c" > /dev/null; done  # unknown names fail before any run
unset OPENBLAS_CORETYPE
coretype=$(bash "$ROOT/scripts/openblas-coretype.sh")
[[ -n "$coretype" ]] && export OPENBLAS_CORETYPE=$coretype
if [[ ! -x "$BUILD/examples/train_lm" ]]; then
  cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGRAPHMOE_NATIVE=ON -DGRAPHMOE_ENABLE_CUDA=OFF \
    -DGRAPHMOE_BUILD_TESTS=OFF -DGRAPHMOE_BUILD_BENCHMARKS=OFF -DGRAPHMOE_BUILD_EXAMPLES=ON \
    "-DGRAPHMOE_EXAMPLE_ROUTERS=SoftmaxRouter;SimilarityRouter;AttentionRouter;SigmoidBiasRouter;SimilaritySigmoidBiasRouter;AttentionSigmoidBiasRouter" > /dev/null
  cmake --build "$BUILD" -j "$JOBS" --target train_lm
fi
[[ -s "$ROOT/runs/data/kjv.tokens" ]] || bash "$ROOT/scripts/prepare-kjv.sh" "$ROOT/runs/data/kjv.tokens"
for s in $SEEDS; do for c in "${CELLS[@]}"; do echo "$c $s"; done; done |
  xargs -P "$JOBS" -L 1 bash "$0" --cell
