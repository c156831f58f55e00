#!/usr/bin/env bash
# Builds what the routing study runs (Release, -march=native, CPU only) into build-study/:
# train_lm, train_vision, finetune_classifier, routing_report and bench_model_cost.
#   BUILD=build-study JOBS=2 scripts/study/build.sh
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${BUILD:-$ROOT/build-study}
cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGRAPHMOE_NATIVE=ON -DGRAPHMOE_ENABLE_CUDA=OFF \
  -DGRAPHMOE_BUILD_TESTS=OFF -DGRAPHMOE_BUILD_BENCHMARKS=ON -DGRAPHMOE_BUILD_EXAMPLES=ON > /dev/null
cmake --build "$BUILD" -j "${JOBS:-2}" --target train_lm train_vision finetune_classifier routing_report bench_model_cost
