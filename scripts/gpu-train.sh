#!/usr/bin/env bash
# The example training loop on a GPU, in one device call (steps 1-3 took about 4 minutes on one
# H100; step 4 adds about two, not yet measured):
#   1. the main job with --device cuda (scripts/main-job.sh, OFFLINE=1: no apt, the dependencies
#      and the corpus carried): train_lm built with CPU and CUDA loops for softmax and similarity,
#      compiled for the GPU present, then both 1,500-step runs on the King James Bible
#   2. the same short run (2 blocks, 8 steps, similarity router) with --device cpu and --device
#      cuda from one seed: their validation perplexities agree to float round-off
#   3. each device resumes the other's step-8 checkpoint for 4 more steps: the same perplexity again
#   4. the main job again with PRECISION=bf16 (train_lm --precision bf16: every GEMM on bf16
#      operands, fp32 master weights): each router's validation perplexity within 1% of the fp32
#      run's (the target)
#   5. the short run of step 2 with the padded expert layout (capacity 1.25), eager and with
#      --cuda-graph (the step's forward and backward replayed from a CUDA graph): the same
#      validation perplexity to float round-off, and each run's training tokens/s
# Everything is logged to $OUT (or a temporary folder) and summarised in gpu-train-summary.txt.
# Prepare on a networked machine, then carry both to the GPU machine:
#   bash scripts/gpu-deps.sh && bash scripts/prepare-kjv.sh runs/data/kjv.tokens
#   (device run: carry [".gpu-deps", "runs/data"], command: bash scripts/gpu-train.sh)
# STEPS overrides the main job's steps. Exit status: 0 when every run finished and the devices agree.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
logdir=${OUT:-$(mktemp -d)}
mkdir -p "$logdir"
summary=$logdir/gpu-train-summary.txt
: >"$summary"
say() { printf '%s\n' "$*" | tee -a "$summary"; }
status=0

say "== graphmoe gpu-train, $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
command -v nvidia-smi >/dev/null &&
  say "gpu: $(nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader | head -1)"
t0=$(date +%s)
if OFFLINE=1 JOBS=$(nproc) DEVICE=cuda bash scripts/main-job.sh >"$logdir/main-job.log" 2>&1; then
  say "-- main job, --device cuda ($(( $(date +%s) - t0 )) s, build included)"
  tail -n 6 "$logdir/main-job.log" | tee -a "$summary"
else
  say "FAIL: main job (log: main-job.log)"; tail -n 30 "$logdir/main-job.log" | tee -a "$summary"
  status=1
fi

train=./build-main/examples/train_lm
if [[ -x $train ]]; then
  small=(--train runs/data/kjv.tokens --test "" --valid-fraction 0.05 --max-vocab 4000 --layers 2
         --d-model 64 --heads 4 --d-ff 128 --experts 4 --top-k 2 --seq 32 --batch 8 --warmup 2
         --lr 2e-3 --eval-every 0 --eval-batches 20 --threads 4 --seed 3 --router similarity --tau 16)
  rm -rf runs/gpu-eq
  ppl() { sed -n 's/.*val_ppl=\([0-9.naif]*\).*/\1/p' "$1" | tail -n 1; }
  run() {  # run NAME DEVICE STEPS [--resume]
    if "$train" "${small[@]}" --device "$2" --steps "$3" --out "runs/gpu-eq/$1" "${@:4}" \
        >"$logdir/eq-$1-$3.log" 2>&1; then
      printf '%s\n' "$(ppl "$logdir/eq-$1-$3.log")"
    else
      echo "failed"; tail -n 5 "$logdir/eq-$1-$3.log" >&2
    fi
  }
  cpu8=$(run cpu cpu 8) cuda8=$(run cuda cuda 8)
  cp -r runs/gpu-eq/cpu runs/gpu-eq/cpu-then-cuda
  cp -r runs/gpu-eq/cuda runs/gpu-eq/cuda-then-cpu
  cpu12=$(run cpu cpu 12 --resume) cuda12=$(run cuda cuda 12 --resume)
  x12=$(run cpu-then-cuda cuda 12 --resume) y12=$(run cuda-then-cpu cpu 12 --resume)
  say "-- the same short run on both devices (val ppl): step 8 cpu $cpu8 cuda $cuda8;" \
      "step 12 cpu $cpu12 cuda $cuda12, cpu->cuda $x12, cuda->cpu $y12"
  if ! /usr/bin/env python3 - "$cpu8" "$cuda8" "$cpu12" "$cuda12" "$x12" "$y12" <<'PY' | tee -a "$summary"
import sys
v = [float(x) for x in sys.argv[1:]]
pairs = [("step 8", v[0], v[1]), ("step 12", v[2], v[3]), ("resumed", v[2], v[4]), ("resumed", v[2], v[5])]
worst = max(abs(a - b) / a for _, a, b in pairs)
print(f"largest relative difference {worst:.2e} (pass: < 1e-4)")
sys.exit(0 if worst < 1e-4 else 1)
PY
  then
    say "FAIL: the devices disagree (or a run failed)"; status=1
  fi
  graph_args=(--expert-layout padded --capacity-factor 1.25 --steps 40)
  tps() {  # the last evaluation row's training tokens/s (metrics.csv)
    /usr/bin/env python3 -c 'import csv, sys; print(list(csv.DictReader(open(sys.argv[1])))[-1]["tokens_per_s"])' "$1/metrics.csv" 2>/dev/null || echo "?"
  }
  if "$train" "${small[@]}" --device cuda "${graph_args[@]}" --out runs/gpu-eq/padded \
       >"$logdir/graph-eager.log" 2>&1 &&
     "$train" "${small[@]}" --device cuda "${graph_args[@]}" --cuda-graph --out runs/gpu-eq/graph \
       >"$logdir/graph-replayed.log" 2>&1; then
    e=$(ppl "$logdir/graph-eager.log") g=$(ppl "$logdir/graph-replayed.log")
    say "-- padded, eager vs --cuda-graph (val ppl after 40 steps): $e vs $g;" \
        "tok/s $(tps runs/gpu-eq/padded) vs $(tps runs/gpu-eq/graph)"
    grep -h "cuda-graph:" "$logdir/graph-replayed.log" | tee -a "$summary"
    if ! /usr/bin/env python3 -c 'import sys; a, b = float(sys.argv[1]), float(sys.argv[2]); sys.exit(0 if abs(b - a) / a < 1e-4 else 1)' "$e" "$g" 2>/dev/null; then
      say "FAIL: --cuda-graph changed the result"; status=1
    fi
  else
    say "FAIL: the --cuda-graph comparison (logs: graph-eager.log, graph-replayed.log)"
    tail -n 10 "$logdir/graph-replayed.log" | tee -a "$summary"
    status=1
  fi
else
  say "FAIL: no train_lm to compare the devices with"; status=1
fi
t1=$(date +%s)
if OFFLINE=1 JOBS=$(nproc) DEVICE=cuda PRECISION=bf16 bash scripts/main-job.sh >"$logdir/main-job-bf16.log" 2>&1; then
  say "-- main job, --device cuda --precision bf16 ($(( $(date +%s) - t1 )) s)"
  tail -n 6 "$logdir/main-job-bf16.log" | tee -a "$summary"
  ppl_of() { sed -n 's/.*val_ppl=\([0-9.naif]*\).*/\1/p' "$1" | tail -n 1; }
  for r in softmax similarity; do
    f32=$(ppl_of "runs/main-$r.txt") b16=$(ppl_of "runs/main-$r-bf16.txt")
    if /usr/bin/env python3 -c 'import sys; a, b = float(sys.argv[1]), float(sys.argv[2]); sys.exit(0 if abs(b - a) / a < 0.01 else 1)' "$f32" "$b16" 2>/dev/null; then
      say "-- $r: val ppl fp32 $f32, bf16 $b16: within 1% (PASS)"
    else
      say "FAIL: $r: val ppl fp32 '$f32', bf16 '$b16': not within 1%"; status=1
    fi
  done
else
  say "FAIL: main job with --precision bf16 (log: main-job-bf16.log)"; tail -n 30 "$logdir/main-job-bf16.log" | tee -a "$summary"
  status=1
fi
say "== total $(( $(date +%s) - t0 )) s, status $([[ $status == 0 ]] && echo PASS || echo FAIL)"
exit $status
