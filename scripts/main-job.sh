#!/usr/bin/env bash
# The main job: on a fresh Debian 12 machine, install what is needed, build in Release, and train a
# softmax SMoE LM and a Similarity-Aware SMoE LM of the same shape on the King James Bible
# (Debian's bible-kjv), then print their validation perplexities side by side.
# About 4 minutes on 2 cores (248 s from a fresh clone, build included; the two
# training runs are most of it). Outputs (metrics.csv, checkpoints) under runs/main/.
#   STEPS=1200 scripts/main-job.sh      (override the number of training steps)
#   DEVICE=cuda scripts/main-job.sh     (train on the GPU; needs nvcc and a CUDA device; compiles for
#                                        the GPU present: CMAKE_CUDA_ARCHITECTURES=native)
#   DEVICE=cuda PRECISION=bf16 scripts/main-job.sh
#                                       (mixed precision: train_lm --precision bf16, outputs beside the
#                                        fp32 ones as runs/main-<router>-bf16.txt, runs/main-bf16/)
#   OFFLINE=1 JOBS=16 DEVICE=cuda scripts/main-job.sh
#       (a machine without package access, e.g. the lent GPU machine: no apt; the build dependencies
#       from .gpu-deps (scripts/gpu-deps.sh) and the corpus from runs/data/kjv.tokens, both prepared
#       on a networked machine and carried; JOBS parallel build jobs, default 2)
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${STEPS:-1500}
device=${DEVICE:-cpu}
case "$device" in
  cpu) cuda_args=(-DGRAPHMOE_ENABLE_CUDA=OFF) ;;  # no nvcc translation units to build
  cuda) cuda_args=(-DGRAPHMOE_ENABLE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=native "-DGRAPHMOE_CUDA_EXAMPLES=train_lm"
                   "-DGRAPHMOE_CUDA_EXAMPLE_ROUTERS=SoftmaxRouter;SimilarityRouter") ;;
  *) echo "main-job.sh: DEVICE must be cpu or cuda, got '$device'" >&2; exit 2 ;;
esac
precision=${PRECISION:-fp32}
case "$precision" in
  fp32) tag="" ;;
  bf16) tag="-bf16"
        [[ "$device" == cuda ]] || { echo "main-job.sh: PRECISION=bf16 needs DEVICE=cuda" >&2; exit 2; } ;;
  *) echo "main-job.sh: PRECISION must be fp32 or bf16, got '$precision'" >&2; exit 2 ;;
esac
# Let OpenBLAS pick its kernels for this CPU: a forced OPENBLAS_CORETYPE=Haswell (set in some of
# our sandboxes) halves GEMM speed on AVX-512 machines (docs/benchmarks.md) ...
unset OPENBLAS_CORETYPE

dep_args=()
if [[ -n "${OFFLINE:-}" ]]; then
  source scripts/gpu-deps-env.sh "$PWD"
  (( ${#dep_args[@]} > 0 )) || { echo "main-job.sh: OFFLINE needs .gpu-deps (scripts/gpu-deps.sh)" >&2; exit 2; }
  [[ -s runs/data/kjv.tokens ]] || { echo "main-job.sh: OFFLINE needs runs/data/kjv.tokens (scripts/prepare-kjv.sh)" >&2; exit 2; }
else
  bash scripts/install-deps.sh
fi
# ... unless it does not know the CPU and falls back to its SSE3 kernels (Prescott): then the core
# type the CPU's flags support (scripts/openblas-coretype.sh)
coretype=$(bash scripts/openblas-coretype.sh)
if [[ -n "$coretype" ]]; then
  export OPENBLAS_CORETYPE=$coretype
  echo "main-job.sh: OpenBLAS does not know this CPU (Prescott kernels); OPENBLAS_CORETYPE=$coretype" >&2
fi
# Only the two routers the job trains are compiled (GRAPHMOE_EXAMPLE_ROUTERS): 2 of train_lm's 9
# router translation units.
cmake -S . -B build-main -DCMAKE_BUILD_TYPE=Release -DGRAPHMOE_NATIVE=ON \
  -DGRAPHMOE_BUILD_TESTS=OFF -DGRAPHMOE_BUILD_BENCHMARKS=OFF -DGRAPHMOE_BUILD_EXAMPLES=ON \
  "-DGRAPHMOE_EXAMPLE_ROUTERS=SoftmaxRouter;SimilarityRouter" "${cuda_args[@]}" "${dep_args[@]}" > /dev/null
cmake --build build-main -j "${JOBS:-2}" --target train_lm
[[ -n "${OFFLINE:-}" ]] || scripts/prepare-kjv.sh runs/data/kjv.tokens

# 4 blocks, D = 128, 4 heads, E = 8 experts of d_ff = 256, top-2, sequences of 64 tokens.
# The Similarity graph uses tau = 32 (= D / 4): at the paper's tau = 1 the layer-normed tokens'
# self-similarity |u|^2 ~ D dominates every row and S is the identity (docs/routers.md).
common=(--train runs/data/kjv.tokens --test "" --valid-fraction 0.05 --max-vocab 8000
        --layers 4 --d-model 128 --heads 4 --d-ff 256 --experts 8 --top-k 2 --seq 64 --batch 16
        --steps "$steps" --warmup 50 --lr 2e-3 --min-lr 2e-4 --eval-every 100 --eval-batches 20
        --load-balance 0.01 --threads 2 --seed 1 --device "$device" --precision "$precision")
./build-main/examples/train_lm "${common[@]}" --router softmax --out "runs/main$tag/softmax" | tee "runs/main-softmax$tag.txt"
./build-main/examples/train_lm "${common[@]}" --router similarity --tau 32 --out "runs/main$tag/similarity" | tee "runs/main-similarity$tag.txt"

field() { sed -n "s|.*$1=\([0-9.na/]*\).*|\1|p" "$2"; }  # n/a: one evaluation, no fluctuation
row() { printf '%-24s %10s %14s %13s\n' "$1" "$(field val_ppl "$2")" "$(field graph_entropy "$2")" "$(field fluctuation "$2")"; }
echo
echo "King James Bible, $steps steps, validation = last 5% of the verses${tag:+, --precision $precision}"
printf '%-24s %10s %14s %13s\n' "model" "val ppl" "graph entropy" "fluctuation"
row "softmax SMoE" "runs/main-softmax$tag.txt"
row "Similarity-Aware SMoE" "runs/main-similarity$tag.txt"
echo "graph entropy: mean row entropy of the token graph (nats; 0 = each token routes alone)"
echo "fluctuation: share of 1,024 probe tokens whose top-2 experts changed over the last 100 steps"
echo
echo "samples: the first 8 validation tokens >>> 24 drawn by incremental decoding (temperature 0.8, top-k 40, seed 1)"
echo "  softmax SMoE:          $(sed -n 's/^sample: //p' "runs/main-softmax$tag.txt")"
echo "  Similarity-Aware SMoE: $(sed -n 's/^sample: //p' "runs/main-similarity$tag.txt")"
