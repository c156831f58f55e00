#!/usr/bin/env bash
# The LM study of docs/results.md (softmax / Similarity / Attention, 3 seeds) at the paper's medium
# shape on a GPU, in device calls that each fit a device call's time limit:
#   6 blocks, D = 352, 8 heads, E = 16 experts of d_ff = 352, top-2, sequences of T = 512, batch 16
#   (8,192 tokens a step), EPOCHS (60) epochs of the study's corpus (WikiText-2: train on
#   wiki.valid.tokens, 206,764 tokens = 25 steps an epoch; validation its last 5%; test
#   wiki.test.tokens clean and with 10% of its words attacked), AdamW 1e-3 -> 1e-4 cosine after 100
#   warmup steps, load balancing 0.01, vocabulary of the 8,000 most frequent words, tau = D / 4 = 88
#   for the Similarity graph (as the 2-core study's D / 4), sigma 1 for the Attention graph.
#   Fixed before any run and the same for every router; not tuned.
# Cells run seed by seed (s1: softmax, similarity, attention; then s2, s3). A finished cell's
# result (the `router=` line with val/test perplexities, its wall time and metrics.csv) is written
# to RESULTS (benchmarks/results/gpu/study/<precision>/<router>/s<seed>/): commit it, and the next
# device call (the working tree travels) skips it. A cell is started only when the time left in
# GRAPHMOE_GPU_BUDGET_S (default 480 s, the build included) is at least CELL_S (default 150 s), and
# runs under `timeout` for what is left: an unfinished cell leaves nothing behind.
#   bash scripts/gpu-study.sh                          (device call: carry [".gpu-deps", "runs/data"])
#   PRECISION=fp32 SEEDS=1 EPOCHS=60 bash scripts/gpu-study.sh
#   SKIP_BUILD=1 ...                                  (a second call on a still-warm machine)
# Prepare on a networked machine: bash scripts/gpu-deps.sh, and copy the corpus beside the tree:
#   mkdir -p runs/data && cp -r ../shared/data/wikitext-2 runs/data/
# Writes $OUT/gpu-study-summary.txt (the table: mean +- std over the finished seeds) and copies
# the finished cells' results under $OUT/study/. Exit status 0 when no cell failed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
root=$(pwd)
t0=$SECONDS
budget=${GRAPHMOE_GPU_BUDGET_S:-480}
cell_s=${CELL_S:-150}
precision=${PRECISION:-bf16}
epochs=${EPOCHS:-60}
seeds=${SEEDS:-"1 2 3"}
routers=${ROUTERS:-"softmax similarity attention"}
results=${RESULTS:-$root/benchmarks/results/gpu/study/$precision}
build=${BUILD:-$root/build-gpu-study}
logdir=${OUT:-$(mktemp -d)}
mkdir -p "$logdir" "$results"
summary=$logdir/gpu-study-summary.txt
: >"$summary"
say() { printf '%s\n' "$*" | tee -a "$summary"; }
left() { echo $(( budget - (SECONDS - t0) )); }
case "$precision" in fp32|bf16) ;; *) say "gpu-study: PRECISION must be fp32 or bf16, got '$precision'"; exit 2 ;; esac
[[ "$epochs" =~ ^[1-9][0-9]{0,3}$ ]] || { say "gpu-study: EPOCHS must be 1..9999, got '$epochs'"; exit 2; }
for r in $routers; do
  case "$r" in softmax|similarity|attention) ;; *) say "gpu-study: unknown router '$r'"; exit 2 ;; esac
done

data=""
for d in "${GRAPHMOE_DATA_DIR:-}" "$root/runs/data" "$root/../shared/data" /work/shared/data; do
  [[ -n "$d" && -s "$d/wikitext-2/wiki.valid.tokens" ]] && { data=$d/wikitext-2; break; }
done
[[ -n "$data" ]] || { say "gpu-study: no wikitext-2 (runs/data/wikitext-2, ../shared/data or GRAPHMOE_DATA_DIR)"; exit 2; }

say "== graphmoe gpu-study, $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), --precision $precision, $epochs epochs, seeds $seeds"
command -v nvidia-smi >/dev/null &&
  say "gpu: $(nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader | head -1)"

source scripts/gpu-deps-env.sh "$root"
routers_cmake="SoftmaxRouter;SimilarityRouter;AttentionRouter"
if [[ -n "${SKIP_BUILD:-}" && -x "$build/examples/train_lm" ]]; then
  say "-- SKIP_BUILD: train_lm of $build"
elif ! timeout "$(left)" cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DGRAPHMOE_NATIVE=ON \
      -DGRAPHMOE_BUILD_TESTS=OFF -DGRAPHMOE_BUILD_BENCHMARKS=OFF -DGRAPHMOE_BUILD_EXAMPLES=ON \
      -DGRAPHMOE_ENABLE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=native -DGRAPHMOE_CUDA_EXAMPLES=train_lm \
      "-DGRAPHMOE_EXAMPLE_ROUTERS=$routers_cmake" "-DGRAPHMOE_CUDA_EXAMPLE_ROUTERS=$routers_cmake" \
      "${dep_args[@]}" >"$logdir/build.log" 2>&1 ||
   ! timeout "$(left)" cmake --build "$build" -j "$(nproc)" --target train_lm >>"$logdir/build.log" 2>&1; then
  say "FAIL: build (log: build.log)"; tail -n 30 "$logdir/build.log" | tee -a "$summary"; exit 1
else
  say "-- train_lm built ($(( SECONDS - t0 )) s)"
fi

batch=16 seq=512
epoch_steps=$(( 206764 / (batch * seq) ))
args=(--train "$data/wiki.valid.tokens" --test "$data/wiki.test.tokens" --max-vocab 8000
      --layers 6 --d-model 352 --heads 8 --d-ff 352 --experts 16 --top-k 2 --seq "$seq"
      --batch "$batch" --steps $(( epochs * epoch_steps )) --warmup 100 --lr 1e-3 --min-lr 1e-4
      --eval-every $(( 10 * epoch_steps )) --load-balance 0.01 --attack-rate 0.1 --attack-seed 1
      --threads 4 --device cuda --precision "$precision")
status=0
for s in $seeds; do
  for r in $routers; do
    cell=$results/$r/s$s
    if [[ -s $cell/result.txt ]]; then say "skip $r s$s (done): $(cat "$cell/result.txt")"; continue; fi
    if (( $(left) < cell_s )); then say "stop: $(left) s left, a cell needs about $cell_s s"; break 2; fi
    extra=()
    [[ $r == similarity ]] && extra=(--tau 88)
    tmp=$(mktemp -d)
    c0=$SECONDS
    if timeout "$(left)" "$build/examples/train_lm" "${args[@]}" --router "$r" --seed "$s" \
         --out "$tmp/run" "${extra[@]}" >"$logdir/$r-s$s.out" 2>"$logdir/$r-s$s.err"; then
      mkdir -p "$cell"
      cp "$tmp/run/metrics.csv" "$cell/" 2>/dev/null
      echo "$(grep '^router=' "$logdir/$r-s$s.out" | tail -n 1) wall_s=$(( SECONDS - c0 )) tokens=$(( epochs * epoch_steps * batch * seq ))" >"$cell/result.txt"
      say "done $r s$s: $(cat "$cell/result.txt")"
    else
      say "FAIL or out of time: $r s$s after $(( SECONDS - c0 )) s (log: $r-s$s.err)"
      tail -n 5 "$logdir/$r-s$s.err" | tee -a "$summary"
      status=1
    fi
    rm -rf "$tmp"
  done
done

mkdir -p "$logdir/study"
cp -r "$results" "$logdir/study/" 2>/dev/null
/usr/bin/env python3 - "$results" "$routers" <<'PY' | tee -a "$summary"
import pathlib, re, statistics, sys
root, routers = pathlib.Path(sys.argv[1]), sys.argv[2].split()
print(f"{'router':<12} {'seeds':>5} {'val ppl':>18} {'test ppl':>18} {'attacked ppl':>18}")
for r in routers:
    vals = {"val_ppl": [], "test_ppl": [], "attacked_test_ppl": []}
    files = sorted((root / r).glob("s*/result.txt"))
    for f in files:
        line = f.read_text()
        for k in vals:
            m = re.search(rf"\b{k}=([0-9.]+)", line)
            if m: vals[k].append(float(m.group(1)))
    def cell(v):
        if not v: return "-"
        return f"{statistics.mean(v):.2f} +- {statistics.stdev(v):.2f}" if len(v) > 1 else f"{v[0]:.2f}"
    print(f"{r:<12} {len(files):>5} {cell(vals['val_ppl']):>18} {cell(vals['test_ppl']):>18} {cell(vals['attacked_test_ppl']):>18}")
PY
say "== total $(( SECONDS - t0 )) s, status $([[ $status == 0 ]] && echo PASS || echo FAIL)"
exit $status
