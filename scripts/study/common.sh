# scripts/study/common.sh: shared settings and cell runners of the routing study (docs/results.md).
# Sourced by the study scripts; every cell writes under runs/study/<study>/<cell>/s<seed>/ and is
# skipped when its result file exists, so a study reruns only what is missing, and any one cell
# reruns alone after `rm -r` of its folder (or FORCE=1).
#   BUILD=build-study    the build folder with the examples (scripts/study/build.sh makes it)
#   RUNS=runs/study      where the cells write
#   THREADS=1            threads per run (the scripts run JOBS=2 runs side by side on 2 cores)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BUILD=${BUILD:-$ROOT/build-study}
RUNS=${RUNS:-$ROOT/runs/study}
DATA=${GRAPHMOE_DATA_DIR:-$ROOT/../shared/data}
THREADS=${THREADS:-1}
export OPENBLAS_NUM_THREADS=1
unset OPENBLAS_CORETYPE
# OpenBLAS's SSE3 fallback on a CPU it does not know: the core type the flags support instead
OPENBLAS_CORETYPE=$(bash "$ROOT/scripts/openblas-coretype.sh")
[[ -n "$OPENBLAS_CORETYPE" ]] && export OPENBLAS_CORETYPE || unset OPENBLAS_CORETYPE

# ---- language modelling (WikiText-2: train on wiki.valid.tokens, test on wiki.test.tokens) -----
# Fixed before any router was compared, the same for every router of the LM studies:
# 4 blocks, D = 128, 4 heads, E = 16 experts of d_ff = 128 (the paper's d_ff = D), top-2,
# sequences of 128 tokens, batch 8 (1,024 tokens a step), 3 epochs of the 206,764 training tokens
# (201 steps each, 603 steps), AdamW 2e-3 -> 2e-4 cosine after 50 warmup steps, load balancing
# 0.01, vocabulary of the 8,000 most frequent words. The last 5% of wiki.valid.tokens is the
# validation set; the test set is wiki.test.tokens, clean and with 10% of its words attacked.
LM_EPOCH_STEPS=201
LM_ARGS=(--train "$DATA/wikitext-2/wiki.valid.tokens" --test "$DATA/wikitext-2/wiki.test.tokens"
         --max-vocab 8000 --layers 4 --d-model 128 --heads 4 --d-ff 128 --experts 16 --top-k 2
         --seq 128 --batch 8 --steps $((3 * LM_EPOCH_STEPS)) --warmup 50 --lr 2e-3 --min-lr 2e-4
         --eval-every "$LM_EPOCH_STEPS" --checkpoint-every "$LM_EPOCH_STEPS" --keep-checkpoints
         --load-balance 0.01 --attack-rate 0.1 --attack-seed 1 --threads "$THREADS")
LM_TAU=32  # D / 4: see docs/results.md ("Temperature") for why not the paper's tau = 1

# lm_cell STUDY CELL SEED ROUTER [train_lm options...]: one training run + its routing reports.
lm_cell() {
  local study=$1 cell=$2 seed=$3 router=$4
  shift 4
  local dir=$RUNS/$study/$cell/s$seed
  if [ -s "$dir/result.txt" ] && [ "${FORCE:-0}" != 1 ]; then echo "skip $study/$cell/s$seed"; return 0; fi
  need "$BUILD/examples/train_lm" "$BUILD/examples/routing_report"
  rm -rf "$dir" && mkdir -p "$dir"
  local t0=$SECONDS
  "$BUILD/examples/train_lm" "${LM_ARGS[@]}" --router "$router" --seed "$seed" --out "$dir" "$@" \
    > "$dir/train.out" 2> "$dir/train.err"
  # the report needs routing_report and, for the entropy ratio, the softmax model of this seed:
  # scripts/study/reports.sh reruns it for every finished cell
  lm_report "$dir" "$(lm_baseline "$study" "$cell" "s$seed")" ||
    echo "lm_report failed for $dir (rerun scripts/study/reports.sh)" >&2
  # result.txt last: its presence marks the cell done
  echo "$(grep '^router=' "$dir/train.out") wall_s=$((SECONDS - t0))" > "$dir/result.txt.tmp"
  mv "$dir/result.txt.tmp" "$dir/result.txt"
  echo "done $study/$cell/s$seed: $(cat "$dir/result.txt")"
}

need() {  # need FILE...: every program the cell runs must be built
  local f
  for f in "$@"; do
    [ -x "$f" ] || { echo "$f is missing: run scripts/study/build.sh" >&2; return 1; }
  done
}

# lm_baseline STUDY CELL SEED: the finished model whose routing entropy a cell is divided by: the
# same layout and scorer without a graph (GLaM cells: plugin/glam; X-MoE: plugin/xmoe;
# SMoE-Dropout: plugin/smoe-dropout; every other cell: lm/softmax), of the same seed.
lm_baseline() {
  local base
  case "$1/$2" in
    plugin/glam*) base=plugin/glam ;;
    plugin/xmoe*) base=plugin/xmoe ;;
    plugin/smoe-dropout*) base=plugin/smoe-dropout ;;
    *) base=lm/softmax ;;
  esac
  echo "$RUNS/$base/$3"
}

# lm_report DIR [BASELINE_DIR]: routing report of the final checkpoint against the previous
# epoch's (fluctuation between the last two epochs) and, once that cell has finished, against the
# baseline's final model (entropy ratio). Returns non-zero when the report could not be made.
lm_report() {
  local dir=$1 base=${2:-}
  local steps last prev
  steps=$(find "$dir" -maxdepth 1 -name 'checkpoint-step*.safetensors' | sed 's/.*step\([0-9]*\)\.safetensors$/\1/' | sort -n)
  last=$(echo "$steps" | tail -1)
  prev=$(echo "$steps" | tail -2 | head -1)
  [ -n "$last" ] && [ "$last" != "$prev" ] || { echo "lm_report: $dir has fewer than two epoch checkpoints" >&2; return 1; }
  local args=(--checkpoint "$dir/checkpoint.safetensors" --compare "$dir/checkpoint-step$prev.safetensors"
              --text "$DATA/wikitext-2/wiki.test.tokens" --probe-batches 16 --batch 8
              --threads "$THREADS" --out "$dir/report.csv")
  # only a finished baseline: its checkpoint.safetensors is rewritten every epoch while it trains
  [ -n "$base" ] && [ "$base" != "$dir" ] && [ -s "$base/result.txt" ] && args+=(--baseline "$base/checkpoint.safetensors")
  "$BUILD/examples/routing_report" "${args[@]}" > "$dir/report.out" 2> "$dir/report.err" || {
    echo "lm_report: routing_report failed for $dir: $(tail -n 1 "$dir/report.err")" >&2
    return 1
  }
  # the epoch checkpoints are large (model + AdamW state); keep the last two only
  local f
  for f in "$dir"/checkpoint-step*.safetensors; do
    case "$f" in *step$last.*|*step$prev.*) ;; *) rm -f "$f" ;; esac
  done
  return 0
}

# ---- vision: V-MoE on Fashion-MNIST (Table 2, Figure 4) ------------------------------------------
# 4 blocks, D = 64, 4 heads, MoE in the last 2 (E = 8, d_ff = 128, top-2), patches of 7 (16
# tokens + the class token), batch 64, 30,000 training images once, AdamW 2e-3; the Similarity
# graph at tau = D / 4 = 16 (tau = 1 would be the identity, as in the LM). Test: the 10,000 test
# images clean and under Gaussian noise, blur and contrast at severity 3 (seed 1).
VISION_ARGS=(--epochs 1 --train-limit 30000 --batch 64 --lr 2e-3 --warmup 50 --tau 16
             --load-balance 0.01 --corrupt all --severity 3 --corrupt-seed 1 --threads "$THREADS")

# vision_cell CELL SEED [ROUTER [ARGS...]]: ROUTER defaults to CELL; ARGS go to train_vision.
vision_cell() {
  local cell=$1 seed=$2 router=${3:-$1} dir=$RUNS/vision/$1/s$2
  shift $(($# < 3 ? $# : 3))
  if [ -s "$dir/result.txt" ] && [ "${FORCE:-0}" != 1 ]; then echo "skip vision/$cell/s$seed"; return 0; fi
  need "$BUILD/examples/train_vision"
  rm -rf "$dir" && mkdir -p "$dir"
  local t0=$SECONDS
  "$BUILD/examples/train_vision" "${VISION_ARGS[@]}" --router "$router" --seed "$seed" --out "$dir" \
    "$@" > "$dir/train.out" 2> "$dir/train.err"
  echo "$(grep '^router=' "$dir/train.out") wall_s=$((SECONDS - t0))" > "$dir/result.txt.tmp"
  mv "$dir/result.txt.tmp" "$dir/result.txt"
  echo "done vision/$cell/s$seed: $(cat "$dir/result.txt")"
}

# ---- fine-tuning (Table 3): the LM of lm/<router>/s<seed> on one task ---------------------------
# 8,000 training examples (all of SST-5's 8,544 and Banking-77's 10,003 would be the full sets;
# the cap keeps every cell near two minutes), one epoch, batch 16, lr 1e-3, the same for every
# router.
FINETUNE_ARGS=(--train-limit 8000 --epochs 1 --batch 16 --lr 1e-3 --threads "$THREADS")

finetune_cell() {
  local router=$1 task=$2 seed=$3 dir=$RUNS/finetune/$1-$2/s$3
  local lm=$RUNS/lm/$router/s$seed
  if [ -s "$dir/result.txt" ] && [ "${FORCE:-0}" != 1 ]; then echo "skip finetune/$router-$task/s$seed"; return 0; fi
  [ -s "$lm/result.txt" ] || { echo "finetune: $lm is not trained yet (run scripts/study/all.sh lm)" >&2; return 1; }
  need "$BUILD/examples/finetune_classifier"
  rm -rf "$dir" && mkdir -p "$dir"
  local t0=$SECONDS
  "$BUILD/examples/finetune_classifier" "${FINETUNE_ARGS[@]}" --checkpoint "$lm/checkpoint.safetensors" \
    --vocab "$lm/vocab.txt" --task "$task" --seed "$seed" --out "$dir" > "$dir/train.out" 2> "$dir/train.err"
  echo "task=$task $(grep '^router=' "$dir/train.out" | tail -n 1) wall_s=$((SECONDS - t0))" > "$dir/result.txt.tmp"
  mv "$dir/result.txt.tmp" "$dir/result.txt"
  echo "done finetune/$router-$task/s$seed: $(cat "$dir/result.txt")"
}
