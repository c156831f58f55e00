#!/usr/bin/env bash
# The upcycling study of docs/results.md: does graph upcycling help a trained softmax MoE? A model
# trained here at the main job's scale (scripts/study/modern.sh's softmax cell: King James Bible,
# 4 blocks, D = 128, 4 heads, E = 8 experts of d_ff = 256, top-2 renormalised, auxiliary loss
# 0.01, sequences of 64, batch 16, 1,500 steps, AdamW 2e-3 -> 2e-4, seed 1) is fine-tuned for 500
# more steps (AdamW 1e-3 -> 1e-4 after 20 warm-up steps, the same data) three ways, each from the
# same checkpoint with train_lm --upcycle-from, the hyper-parameters fixed before any row was
# compared and the same for every row:
#
#   as-is                 --router softmax: the model fine-tuned as it is
#   blended-similarity    --router blended-similarity --tau 32: p = (1 - a) r + a S r, a from 0
#   blended-attention     --router blended-attention: the Attention graph, a from 0
#
#   scripts/study/upcycle.sh                 the base model, then every cell for SEEDS (1 2 3)
#   BUILD=build-upcycle JOBS=2 scripts/study/upcycle.sh
#   scripts/study/upcycle.sh --table         the table of docs/results.md from the finished runs
#
# The seed of a fine-tuning run orders its batches (the base model is the same for all). Runs go
# under runs/study/upcycle/ (base/, <cell>/s<seed>/); a finished one is skipped. The build needs
# train_lm with SoftmaxRouter, BlendedSimilarityRouter and BlendedAttentionRouter (BUILD is
# configured here when missing).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${BUILD:-$ROOT/build-upcycle}
RUNS=${UPCYCLE_RUNS:-$ROOT/runs/study/upcycle}
SEEDS=${SEEDS:-"1 2 3"}
JOBS=${JOBS:-2}
CELLS=(as-is blended-similarity blended-attention)
export BUILD RUNS

if [[ "${1:-}" == --table ]]; then
  exec /usr/bin/python3 - "$RUNS" "${CELLS[@]}" <<'EOF'
import csv, glob, json, math, os, struct, sys
runs, cells = sys.argv[1], sys.argv[2:]
def final(d):  # the closing evaluation over the whole validation text (result.txt)
    for field in open(os.path.join(d, "result.txt")).read().split():
        if field.startswith("val_ppl="):
            return float(field.split("=", 1)[1])
    return math.nan
def blends(d):
    p = os.path.join(d, "checkpoint.safetensors")
    with open(p, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        h = json.loads(f.read(n))
        out = []
        for name in sorted(k for k in h if k.endswith("router.graph.blend") and k.startswith("model.")):
            a, b = h[name]["data_offsets"]
            f.seek(8 + n + a)
            out.append(struct.unpack("<f", f.read(4))[0])
        return out
base = os.path.join(runs, "base")
print(f"base model (seed 1, 1,500 steps): validation perplexity {final(base):.2f}\n")
print("| fine-tuning (500 steps) | val ppl, seeds 1-3 | mean | spread (max - min) | a per layer (seed 1) |")
print("|---|---|---|---|---|")
for c in cells:
    ds = sorted(glob.glob(os.path.join(runs, c, "s*")))
    vals = [final(d) for d in ds if os.path.exists(os.path.join(d, "result.txt"))]
    if not vals:
        print(f"| {c} | not run | | | |"); continue
    a = blends(ds[0]) if c != "as-is" else []
    mean = sum(vals) / len(vals)
    print(f"| {c} | {', '.join(f'{v:.2f}' for v in vals)} | {mean:.2f} | {max(vals) - min(vals):.2f} | "
          f"{', '.join(f'{x:.4f}' for x in a) if a else '-'} |")
EOF
fi

unset OPENBLAS_CORETYPE
coretype=$(bash "$ROOT/scripts/openblas-coretype.sh")
[[ -n "$coretype" ]] && export OPENBLAS_CORETYPE=$coretype
if [[ ! -x "$BUILD/examples/train_lm" ]]; then
  cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGRAPHMOE_NATIVE=ON -DGRAPHMOE_ENABLE_CUDA=OFF \
    -DGRAPHMOE_BUILD_TESTS=OFF -DGRAPHMOE_BUILD_BENCHMARKS=OFF \
    -DGRAPHMOE_EXAMPLE_ROUTERS="SoftmaxRouter;BlendedSimilarityRouter;BlendedAttentionRouter" > /dev/null
  cmake --build "$BUILD" -j "$JOBS" --target train_lm
fi
[[ -s "$ROOT/runs/data/kjv.tokens" ]] || bash "$ROOT/scripts/prepare-kjv.sh" "$ROOT/runs/data/kjv.tokens"

COMMON=(--train "$ROOT/runs/data/kjv.tokens" --test "" --valid-fraction 0.05 --max-vocab 8000
        --layers 4 --d-model 128 --heads 4 --d-ff 256 --seq 64 --batch 16 --experts 8 --top-k 2
        --load-balance 0.01 --eval-every 100 --eval-batches 20 --threads 1 --sample-tokens 0)
export OPENBLAS_NUM_THREADS=1

run() {  # dir, then train_lm's options
  local dir=$1; shift
  if [[ -s "$dir/result.txt" ]]; then echo "skip $dir"; return 0; fi
  rm -rf "$dir" && mkdir -p "$dir"
  local t0=$SECONDS
  "$BUILD/examples/train_lm" "${COMMON[@]}" --out "$dir" "$@" > "$dir/train.out" 2> "$dir/train.err" ||
    { echo "FAILED $dir: $(tail -n 2 "$dir/train.err" | tr '\n' ' ')" >&2; return 1; }
  echo "$(grep '^router=' "$dir/train.out") wall_s=$((SECONDS - t0))" > "$dir/result.txt"
  echo "done $dir: $(cat "$dir/result.txt")"
}

if [[ "${1:-}" == --cell ]]; then  # one fine-tuning run: --cell CELL SEED
  cell=$2 seed=$3
  case "$cell" in
    as-is) router=(--router softmax) ;;
    blended-similarity) router=(--router blended-similarity --tau 32) ;;
    blended-attention) router=(--router blended-attention) ;;
    *) echo "upcycle.sh: unknown cell '$cell' (${CELLS[*]})" >&2; exit 2 ;;
  esac
  run "$RUNS/$cell/s$seed" "${router[@]}" --steps 500 --warmup 20 --lr 1e-3 --min-lr 1e-4 \
    --seed "$seed" --upcycle-from "$RUNS/base/checkpoint.safetensors"
  exit $?
fi

run "$RUNS/base" --router softmax --steps 1500 --warmup 50 --lr 2e-3 --min-lr 2e-4 --seed 1
jobs_list=()
for seed in $SEEDS; do for cell in "${CELLS[@]}"; do jobs_list+=("$cell $seed"); done; done
printf '%s\n' "${jobs_list[@]}" | xargs -P "$JOBS" -L 1 bash "$0" --cell
"$0" --table
